package main

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"net"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/bpf"
	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/listener"
)

// tetherd stands in for a running tetherd: a listener group with BPF whose
// accept loops count connections like the proxy does.
func tetherd(t *testing.T, k int) (*listener.Group, *testenv.NetNS, string) {
	t.Helper()
	ns := testenv.NewNetNS(t)
	pin := testenv.BPFFS(t)
	var (
		g   *listener.Group
		err error
	)
	ns.Do(t, func() {
		g, err = listener.Listen("127.0.0.1:0", k, bpf.ModeRequired, slog.New(slog.DiscardHandler),
			listener.WithPinDir(pin), listener.WithPollInterval(20*time.Millisecond))
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.Close() })
	accepted := make(chan struct{}, 64)
	for i, ln := range g.Listeners() {
		st := g.Stats().Slot(i)
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				st.Opened()
				accepted <- struct{}{}
				go func() {
					var b [1]byte
					c.Read(b[:]) // until the client closes
					c.Close()
					st.Finished()
				}()
			}
		}()
	}
	// Five connections, one at a time; two are closed again.
	var conns []net.Conn
	for range 5 {
		c, err := ns.Dial(t, "tcp", g.Listeners()[0].Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		select {
		case <-accepted:
		case <-time.After(5 * time.Second):
			t.Fatal("not accepted")
		}
	}
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	conns[0].Close()
	conns[1].Close()
	deadline := time.Now().Add(5 * time.Second)
	for total(g, k).Closed != 2 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	// The data plane's worker counters.
	w := g.Stats().Worker(7)
	w.Begin()
	w.AddUp(100)
	w.AddDown(2500)
	w.ConnOpened()
	return g, ns, pin
}

type sums struct{ Active, Accepted, Closed uint64 }

func total(g *listener.Group, k int) (s sums) {
	for i := range k {
		l := g.Stats().Slot(i).Load()
		s.Active += l.Active
		s.Accepted += l.Accepted
		s.Closed += l.Closed
	}
	return s
}

func TestStatus(t *testing.T) {
	const k = 3
	g, _, pin := tetherd(t, k)

	var out bytes.Buffer
	if err := status(&out, pin, false, nil); err != nil {
		t.Fatal(err)
	}
	text := out.String()
	t.Logf("tetherctl status:\n%s", text)
	for i := range k {
		l := g.Stats().Slot(i).Load()
		row := regexp.MustCompile(`(?m)^` + strconv.Itoa(i) + `\s+active\s+1\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+0\s*$`).FindStringSubmatch(text)
		if row == nil {
			t.Fatalf("no row for listener %d", i)
		}
		if want := []string{itoa(l.Active), itoa(l.Accepted), itoa(l.Closed), itoa(l.Accepted)}; strings.Join(row[1:], " ") != strings.Join(want, " ") {
			t.Errorf("listener %d row %v, want active accepted closed selected %v", i, row[1:], want)
		}
	}
	if !regexp.MustCompile(`(?m)^7\s+1\s+1\s+0\s+100\s+2500\s+0\s+1\s*$`).MatchString(text) {
		t.Error("no row for worker 7")
	}

	out.Reset()
	if err := status(&out, pin, true, nil); err != nil {
		t.Fatal(err)
	}
	var st Status
	if err := json.Unmarshal(out.Bytes(), &st); err != nil {
		t.Fatalf("json: %v\n%s", err, out.String())
	}
	var s sums
	for _, l := range st.Listeners {
		s.Active += l.Active
		s.Accepted += l.Accepted
		s.Closed += l.Closed
	}
	if s != (sums{Active: 3, Accepted: 5, Closed: 2}) || len(st.Listeners) != k {
		t.Errorf("json listeners %+v: sums %+v, want 3 active, 5 accepted, 2 closed", st.Listeners, s)
	}
	if len(st.Workers) != 1 || !reflect.DeepEqual(st.Workers[0], WorkerStatus{Slot: 7, InFlight: 1, Requests: 1, BytesUp: 100, BytesDown: 2500, Conns: 1}) {
		t.Errorf("json workers %+v", st.Workers)
	}
}

func itoa(v uint64) string { return strconv.FormatUint(v, 10) }

func TestNotRunning(t *testing.T) {
	testenv.RequireBPF(t)
	pin := testenv.BPFFS(t)
	var stdout, stderr bytes.Buffer
	code := run([]string{"status", "--pin-dir", pin}, &stdout, &stderr)
	if code != 1 || !strings.Contains(stderr.String(), "tetherd is not running with BPF (no maps pinned at "+pin+")") {
		t.Errorf("exit %d, stderr %q", code, stderr.String())
	}
	// Not even a bpffs.
	stderr.Reset()
	code = run([]string{"status", "--pin-dir", filepath.Join(t.TempDir(), "none")}, &stdout, &stderr)
	if code != 1 || !strings.Contains(stderr.String(), "tetherd is not running with BPF") {
		t.Errorf("exit %d, stderr %q", code, stderr.String())
	}
}

func TestDrainVerb(t *testing.T) {
	g, ns, pin := tetherd(t, 3)
	var stdout, stderr bytes.Buffer
	if code := run([]string{"listeners", "drain", "1", "--pin-dir", pin}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	t.Log(stdout.String())
	// tetherd's watcher closes the listener and empties the slot.
	deadline := time.Now().Add(5 * time.Second)
	for {
		state, _, err := g.Steering().Slot(1)
		if err == nil && state == bpf.SlotEmpty {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("slot 1 not drained: %v %v", state, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := g.Listeners()[1].Accept(); err == nil {
		t.Error("drained listener still accepts")
	}
	// The other listeners still serve.
	c, err := ns.Dial(t, "tcp", g.Listeners()[0].Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	c.Close()

	stderr.Reset()
	if code := run([]string{"listeners", "drain", "1", "--pin-dir", pin}, &stdout, &stderr); code != 1 || !strings.Contains(stderr.String(), "no listener") {
		t.Errorf("draining an empty slot: exit %d, %q", code, stderr.String())
	}

	// Two left: one may go, the last stays.
	if code := run([]string{"listeners", "drain", "2", "--pin-dir", pin}, &stdout, &stderr); code != 0 {
		t.Fatalf("drain 2: exit %d: %s", code, stderr.String())
	}
	stderr.Reset()
	if code := run([]string{"listeners", "drain", "0", "--pin-dir", pin}, &stdout, &stderr); code != 1 || !strings.Contains(stderr.String(), "last active listener") {
		t.Errorf("draining the last active slot: exit %d, %q", code, stderr.String())
	}
	if state, _, _ := g.Steering().Slot(0); state != bpf.SlotActive {
		t.Errorf("last slot %v, want active", state)
	}
}

func TestUsage(t *testing.T) {
	for _, args := range [][]string{nil, {"frobnicate"}, {"listeners"}, {"listeners", "drain"}, {"listeners", "drain", "x"}, {"listeners", "drain", "64"}, {"status", "extra"}} {
		var stdout, stderr bytes.Buffer
		if code := run(args, &stdout, &stderr); code != 2 {
			t.Errorf("%q: exit %d, want 2 (%s)", args, code, stderr.String())
		}
	}
}

// A tetherd that died without clearing slot_table (SIGKILL) still shows as
// not running: the kernel dropped its sockets from listener_sockets.
func TestStatusAfterListenersClosed(t *testing.T) {
	g, _, pin := tetherd(t, 2)
	var out bytes.Buffer
	if err := status(&out, pin, true, nil); err != nil {
		t.Fatalf("running tetherd: %v", err)
	}
	var st Status
	if err := json.Unmarshal(out.Bytes(), &st); err != nil || !st.Running {
		t.Fatalf("running tetherd: running=%v err=%v", st.Running, err)
	}
	for _, ln := range g.Listeners() {
		ln.Close() // no slot_table update, as after a kill
	}
	out.Reset()
	err := status(&out, pin, true, nil)
	if err == nil || !strings.Contains(err.Error(), "tetherd is not running") {
		t.Fatalf("after the sockets closed: err %v", err)
	}
	if err := json.Unmarshal(out.Bytes(), &st); err != nil || st.Running || len(st.Listeners) == 0 {
		t.Fatalf("after the sockets closed: running=%v listeners=%d err=%v (the last counters must still print)", st.Running, len(st.Listeners), err)
	}
}
