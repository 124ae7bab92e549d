package kvevents

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
)

// Interoperation with real libzmq: Debian's python3-zmq and
// python3-msgpack (apt-get install python3-zmq python3-msgpack; .ci/run
// installs them). Skipped loudly when missing and not root; as root a
// missing module fails the test.

// libzmqPython returns a python3 that imports zmq and msgpack.
func libzmqPython(t *testing.T) string {
	for _, py := range []string{"/usr/bin/python3", "python3"} {
		if exec.Command(py, "-c", "import zmq, msgpack").Run() == nil {
			return py
		}
	}
	msg := "INTEROP TEST NOT RUN: no python3 with zmq and msgpack (apt-get install python3-zmq python3-msgpack)"
	if os.Geteuid() == 0 {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return ""
}

func TestInteropLibzmqPublisher(t *testing.T) {
	py := libzmqPython(t)
	for _, topic := range []string{"", "topic"} {
		t.Run("replies"+topic, func(t *testing.T) {
			cmd := exec.Command(py, "testdata/pub.py", topic)
			stdin, _ := cmd.StdinPipe()
			stdout, _ := cmd.StdoutPipe()
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer func() { stdin.Close(); cmd.Wait() }()
			lines := bufio.NewScanner(stdout)
			if !lines.Scan() {
				t.Fatal("publisher printed nothing")
			}
			var pubPort, routerPort int
			if _, err := fmt.Sscanf(lines.Text(), "READY %d %d", &pubPort, &routerPort); err != nil {
				t.Fatalf("%q: %v", lines.Text(), err)
			}
			go func() {
				for lines.Scan() {
				}
			}()
			r := &recorder{}
			var got []Batch
			rec := &batchRecorder{recorder: r, got: &got}
			s, err := Start(Config{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", pubPort),
				Replay: fmt.Sprintf("tcp://127.0.0.1:%d", routerPort), ReplayTimeout: 5 * time.Second}, rec)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			testenv.WaitFor(t, "4 batches from libzmq", func() bool { return s.Stats().Batches == 4 })
			seqs, clears, _ := r.snapshot()
			if fmt.Sprint(seqs) != "[0 1 2 3]" || len(clears) != 0 {
				t.Fatalf("seqs %v clears %v", seqs, clears)
			}
			st := s.Stats()
			if st.Gaps != 1 || st.Replays != 1 || st.ReplayFailures != 0 || st.Malformed != 0 {
				t.Fatalf("stats %+v", st)
			}
			rec.mu.Lock()
			defer rec.mu.Unlock()
			want := []string{
				"0 rank -1: BlockStored [9223372036854775813] parent false tokens [1 2 3 4] size 2",
				"1 rank 0: BlockStored [18446744073709551613] parent false tokens [5 6] size 2",
				"2 rank 0: BlockRemoved [18446744073709551613] parent false tokens [] size 0",
				"3 rank 1: BlockStored [72057594037927943] parent true tokens [7 8] size 2; AllBlocksCleared [] parent false tokens [] size 0",
			}
			for i, b := range got {
				var evs []string
				for _, e := range b.Events {
					evs = append(evs, fmt.Sprintf("%s %v parent %v tokens %v size %d", e.Kind, e.Hashes, e.HasParent, e.Tokens, e.BlockSize))
				}
				if s := fmt.Sprintf("%d rank %d: %s", b.Seq, b.Rank, strings.Join(evs, "; ")); s != want[i] {
					t.Errorf("batch %d:\n got %s\nwant %s", i, s, want[i])
				}
			}
		})
	}
}

// batchRecorder keeps copies of the batches.
type batchRecorder struct {
	*recorder
	got *[]Batch
}

func (b *batchRecorder) Apply(x *Batch) {
	b.recorder.Apply(x)
	c := Batch{Seq: x.Seq, TS: x.TS, Rank: x.Rank}
	for _, e := range x.Events {
		e.Hashes = append([]uint64{}, e.Hashes...)
		e.Tokens = append([]uint32{}, e.Tokens...)
		c.Events = append(c.Events, e)
	}
	b.mu.Lock()
	*b.got = append(*b.got, c)
	b.mu.Unlock()
}

func TestInteropLibzmqSubscriber(t *testing.T) {
	py := libzmqPython(t)
	p, err := NewPublisher(PublisherConfig{Replay: true, Topic: "kv"})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	cmd := exec.Command("timeout", "20", py, "testdata/sub.py", p.Endpoint(), p.ReplayEndpoint())
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, "libzmq SUB subscribed", func() bool { return p.Subscribers() == 1 })
	p.Publish(stored(1), ArrayForm, HashUint)
	p.Publish(stored(2), MapForm, HashInt)
	p.Publish(&Batch{Rank: 0, Events: []Event{{Kind: Cleared}}}, MapForm, HashBytes)
	var lines []string
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("sub.py: %v; printed %q", err, lines)
	}
	want := "CONNECTED|MSG 0 1 BlockStored|MSG 1 1 BlockStored|MSG 2 1 AllBlocksCleared|REPLAY 1|REPLAY 2|REPLAY -1"
	if got := strings.Join(lines, "|"); got != want {
		t.Fatalf("libzmq saw\n %s\nwant\n %s", got, want)
	}
}
