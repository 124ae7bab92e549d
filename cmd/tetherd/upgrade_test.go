package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/tether-rl/tether/bpf"
	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/demo"
)

// readPid reads a pidfile (0 while it is missing).
func readPid(path string) int {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return n
}

func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	return err == nil && !strings.Contains(string(b), ") Z ")
}

// fdTargets lists what a process's descriptors point to.
func fdTargets(pid int) []string {
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	entries, _ := os.ReadDir(dir)
	var out []string
	for _, e := range entries {
		if l, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil {
			out = append(out, l)
		}
	}
	return out
}

func countFDs(pid int) int { return len(fdTargets(pid)) }

// loadStats counts the outcomes of the load.
type loadStats struct {
	ok, failed, streams atomic.Int64
	mu                  sync.Mutex
	errs                []string
}

func (s *loadStats) fail(format string, args ...any) {
	s.failed.Add(1)
	s.mu.Lock()
	if len(s.errs) < 10 {
		s.errs = append(s.errs, fmt.Sprintf(format, args...))
	}
	s.mu.Unlock()
}

// TestUpgradeUnderLoad upgrades tetherd in place (SIGUSR2) again and again
// while keep-alive clients, clients with a new connection per request
// (half of them on session paths) and long SSE streams run: no request may
// fail (refused, reset, 5xx from tetherd, truncated), every stream must
// end complete, every old process must exit, and the pidfile must name
// the newest one. With BPF the pin-directory lock passes from process to
// process; without it (--bpf=off) the sockets alone.
func TestUpgradeUnderLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("builds tetherd")
	}
	dir := t.TempDir()
	bin := build(t, dir, "github.com/tether-rl/tether/cmd/tetherd")
	modes := map[string][]string{"bpf-off": {"--bpf", "off"}}
	bpfOK := false
	t.Run("bpf-available", func(t *testing.T) { testenv.RequireBPF(t); bpfOK = true })
	if bpfOK {
		modes["bpf"] = []string{"--bpf", "required", "--bpf-pin-dir", testenv.BPFFS(t)}
	}
	for name, extra := range modes {
		t.Run(name, func(t *testing.T) { upgradeUnderLoad(t, bin, extra, 10) })
	}
}

func upgradeUnderLoad(t *testing.T, bin string, extra []string, upgrades int) {
	var workers []string
	for i := 0; i < 2; i++ {
		s, err := demo.Start("127.0.0.1:0", demo.Options{Index: i, StreamDelay: 20 * time.Millisecond, StreamChunks: 40})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		workers = append(workers, s.URL())
	}
	pidfile := filepath.Join(t.TempDir(), "tetherd.pid")
	args := append([]string{"--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--listeners", "2",
		"--pidfile", pidfile, "--worker", workers[0], "--worker", workers[1], "--drain-timeout", "30s"}, extra...)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	stderr, _ := cmd.StderrPipe()
	cmd.Stdout = io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var logs logWatch
	go logs.run(stderr)
	t.Cleanup(func() {
		if t.Failed() {
			logs.mu.Lock()
			for _, l := range logs.lines {
				if !strings.Contains(l, "level=INFO") || strings.Contains(l, "upgrade") {
					t.Log(l)
				}
			}
			logs.mu.Unlock()
		}
	})
	data := logs.wait(t, `msg="tetherd serving" listen=(\S+)`)
	admin := logs.wait(t, `msg="admin API serving" admin=(\S+)`)
	pids := []int{cmd.Process.Pid}
	defer func() {
		for _, p := range pids {
			syscall.Kill(p, syscall.SIGKILL)
		}
	}()
	testenv.WaitFor(t, "the pidfile", func() bool { return readPid(pidfile) == pids[0] })
	fdsAtStart := countFDs(pids[0])
	// A worker added at run time survives the upgrades in its slot.
	extraWorker, err := demo.Start("127.0.0.1:0", demo.Options{Index: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer extraWorker.Close()
	resp, err := http.Post("http://"+admin+"/add_worker?url="+url.QueryEscape(extraWorker.URL()), "", nil)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("add_worker: %v %v", resp, err)
	}
	resp.Body.Close()

	var st loadStats
	stop := make(chan struct{})
	var wg sync.WaitGroup
	// The load stops however the test ends: a load left running after a
	// failed step would go on against the next subtest's tetherd.
	var stopOnce sync.Once
	stopLoad := func() { stopOnce.Do(func() { close(stop) }); wg.Wait() }
	defer stopLoad()
	chat := `{"messages":[{"role":"user","content":"hi"}]}`
	var transports []*http.Transport // the clients' pools
	// Keep-alive clients, half on session paths, half keyed.
	for i := 0; i < 6; i++ {
		tr := &http.Transport{MaxIdleConnsPerHost: 2}
		transports = append(transports, tr)
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := &http.Client{Timeout: 20 * time.Second, Transport: tr}
			for k := 0; ; k++ {
				select {
				case <-stop:
					return
				default:
				}
				path := "/v1/chat/completions"
				req, _ := http.NewRequest("POST", "http://"+data+path, strings.NewReader(chat))
				if i%2 == 0 {
					req, _ = http.NewRequest("POST", "http://"+data+"/sessions/w"+strconv.Itoa(k%3)+"-0123456789abcdef0123456789abcdef/v1/chat/completions", strings.NewReader(chat))
				} else {
					req.Header.Set("X-Session-ID", "traj-"+strconv.Itoa(i))
				}
				// A pooled connection whose retiring tetherd closed it idle
				// while this client wrote gets no answer at all: a client
				// may send such a request again only when it is marked
				// idempotent (RFC 9110 9.2.2), as these chat turns are, so
				// Go's transport retries it on a new connection. What the
				// test counts is requests tetherd lost or answered wrong.
				req.Header.Set("Idempotency-Key", strconv.Itoa(i)+"-"+strconv.Itoa(k))
				resp, err := c.Do(req)
				if err != nil {
					st.fail("keep-alive: %v", err)
					continue
				}
				b, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err != nil || resp.StatusCode != 200 || !strings.Contains(string(b), "chat.completion") {
					st.fail("keep-alive: %d %v %.80q", resp.StatusCode, err, b)
					continue
				}
				st.ok.Add(1)
			}
		}()
	}
	// A new connection per request.
	for i := 0; i < 2; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				// As long as the other clients wait for an answer: a SYN
				// the kernel drops is sent again (1 s, 3 s, 7 s, 15 s), and
				// under emulation on a busy host a new tetherd takes up to
				// 20 s to take over; a SYN never answered still fails.
				c, err := net.DialTimeout("tcp", data, 20*time.Second)
				if err != nil {
					st.fail("dial: %v", err)
					continue
				}
				fmt.Fprintf(c, "POST /sessions/w1-0123456789abcdef0123456789abcdef/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(chat), chat)
				c.SetReadDeadline(time.Now().Add(20 * time.Second))
				b, err := io.ReadAll(c)
				c.Close()
				if err != nil || !strings.HasPrefix(string(b), "HTTP/1.1 200") {
					st.fail("new connection: %v %.80q", err, b)
					continue
				}
				st.ok.Add(1)
			}
		}()
	}
	// Long SSE streams: 40 events 20 ms apart, each must end with [DONE].
	for i := 0; i < 2; i++ {
		tr := &http.Transport{}
		transports = append(transports, tr)
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := &http.Client{Timeout: 30 * time.Second, Transport: tr}
			for {
				select {
				case <-stop:
					return
				default:
				}
				resp, err := c.Post("http://"+data+"/v1/chat/completions", "application/json",
					strings.NewReader(`{"stream":true,"messages":[{"role":"user","content":"hi"}]}`))
				if err != nil {
					st.fail("stream: %v", err)
					continue
				}
				events, done := 0, false
				sc := bufio.NewScanner(resp.Body)
				for sc.Scan() {
					if strings.HasPrefix(sc.Text(), "data: ") {
						events++
						done = done || sc.Text() == "data: [DONE]"
					}
				}
				resp.Body.Close()
				if resp.StatusCode != 200 || !done || sc.Err() != nil {
					st.fail("stream: %d, %d events, done %v, %v", resp.StatusCode, events, done, sc.Err())
					continue
				}
				st.streams.Add(1)
			}
		}()
	}

	// The first upgrade comes under load: wait until some went through.
	testenv.WaitFor(t, "load through the first tetherd", func() bool { return st.ok.Load() >= 20 || st.failed.Load() > 0 })
	for u := 0; u < upgrades; u++ {
		old := pids[len(pids)-1]
		syscall.Kill(old, syscall.SIGUSR2)
		// A new process starts in seconds; on an emulated kernel with a
		// busy host it took up to 30 s. Slower is not wrong; never is.
		deadline := time.Now().Add(3 * time.Minute)
		for {
			if p := readPid(pidfile); p != 0 && p != old {
				pids = append(pids, p)
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("upgrade %d: the pidfile still names %d", u, old)
			}
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(150 * time.Millisecond) // load on the new process
	}
	// Load through the newest process, and enough in all, a stream
	// included (a slow machine gets there later, not never).
	after := st.ok.Load()
	testenv.WaitForWithin(t, "load through the newest tetherd", 3*time.Minute, func() bool {
		return st.ok.Load() >= max(after+20, 100) && st.streams.Load() >= 1 || st.failed.Load() > 0
	})
	stopLoad()
	// The clients go away: they close their pools, as a process exiting
	// does. (A retiring tetherd keeps an idle keep-alive connection, a
	// stream's that ended after the upgrade say, open for its client's next
	// request until --idle-timeout.)
	for _, tr := range transports {
		tr.CloseIdleConnections()
	}

	// Every old process exits once it drained; the newest serves, with the
	// run-time worker in its slot.
	for _, p := range pids[:len(pids)-1] {
		deadline := time.Now().Add(40 * time.Second)
		for alive(p) {
			if time.Now().After(deadline) {
				t.Fatalf("old tetherd %d still running", p)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// The verdict comes over a connection of its own (a client's pool is
	// what the load checked).
	fresh := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err = fresh.Post("http://"+data+"/sessions/w2-0123456789abcdef0123456789abcdef/v1/chat/completions", "application/json", strings.NewReader(chat))
	if err != nil || resp.StatusCode != 200 || resp.Header.Get("X-Tether-Demo-Worker") != "2" {
		t.Fatalf("run-time worker after the upgrades: %v %v", resp, err)
	}
	resp.Body.Close()
	t.Logf("%d upgrades: %d requests ok, %d streams complete, %d failed; kernel: %s", upgrades, st.ok.Load(), st.streams.Load(), st.failed.Load(), listenDrops())
	if st.failed.Load() != 0 {
		t.Errorf("%d failed requests, first: %q", st.failed.Load(), st.errs)
	}
	if st.streams.Load() == 0 || st.ok.Load() < 100 {
		t.Errorf("too little load went through: %d requests, %d streams", st.ok.Load(), st.streams.Load())
	}
	last := pids[len(pids)-1]
	// Nothing handed over piles up: no state memfd or readiness pipe left
	// open, and about the descriptors the first process had (its
	// listeners, pin lock, epoll; plus pooled upstream connections).
	fds := fdTargets(last)
	for _, f := range fds {
		if strings.HasPrefix(f, "/memfd:") {
			t.Errorf("the newest tetherd still holds %s", f)
		}
	}
	if len(fds) > fdsAtStart+40 {
		t.Errorf("the newest tetherd holds %d descriptors, the first held %d: %v", len(fds), fdsAtStart, fds)
	}
	t.Logf("descriptors: first process %d at start, newest %d after %d upgrades", fdsAtStart, len(fds), upgrades)
	syscall.Kill(last, syscall.SIGTERM)
	deadline := time.Now().Add(20 * time.Second)
	for alive(last) {
		if time.Now().After(deadline) {
			t.Fatalf("tetherd %d did not stop", last)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, err := os.Stat(pidfile); !os.IsNotExist(err) {
		t.Errorf("pidfile left after SIGTERM: %v", err)
	}
	cmd.Wait()
	// With BPF: the pin directory holds the maps and nothing else, and no
	// process owns it any more (the lock went from process to process and
	// was released by the last one).
	for i, a := range extra {
		if a != "--bpf-pin-dir" || i+1 >= len(extra) {
			continue
		}
		pins := extra[i+1]
		entries, _ := os.ReadDir(pins)
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		if len(names) != 6 {
			t.Errorf("pin directory after the upgrades: %v, want the 6 maps", names)
		}
		s, err := bpf.Open(pins)
		if err != nil {
			t.Fatalf("pin directory still owned after the last tetherd stopped: %v", err)
		}
		s.Close()
	}
}

// TestUpgradePooledClients: clients that keep their connections pooled and
// pause between requests, as agent sessions do (a tool call, a think), go
// on across upgrades without one failed request: a retiring process closes
// no idle keep-alive connection before the idle timeout (daemon.Retire),
// and answers the next request on it, with Connection: close. Half the
// clients send chunked bodies, served on goroutines that keep their
// connections (--park-after -1s); the others are served by the event
// loops.
func TestUpgradePooledClients(t *testing.T) {
	if testing.Short() {
		t.Skip("builds tetherd")
	}
	bin := build(t, t.TempDir(), "github.com/tether-rl/tether/cmd/tetherd")
	extra := []string{"--bpf", "off"}
	bpfOK := false
	t.Run("bpf-available", func(t *testing.T) { testenv.RequireBPF(t); bpfOK = true })
	if bpfOK {
		extra = []string{"--bpf", "required", "--bpf-pin-dir", testenv.BPFFS(t)}
	}
	w, err := demo.Start("127.0.0.1:0", demo.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	pidfile := filepath.Join(t.TempDir(), "tetherd.pid")
	args := append([]string{"--listen", "127.0.0.1:0", "--admin", "off", "--listeners", "2",
		"--pidfile", pidfile, "--worker", w.URL(), "--drain-timeout", "5m", "--park-after", "-1s"}, extra...)
	cmd := exec.Command(bin, args...)
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var logs logWatch
	go logs.run(stderr)
	t.Cleanup(func() {
		if t.Failed() {
			logs.mu.Lock()
			for _, l := range logs.lines {
				if !strings.Contains(l, "level=INFO") || strings.Contains(l, "upgrade") {
					t.Log(l)
				}
			}
			logs.mu.Unlock()
		}
	})
	data := logs.wait(t, `msg="tetherd serving" listen=(\S+)`)
	pids := []int{cmd.Process.Pid}
	defer func() {
		for _, p := range pids {
			syscall.Kill(p, syscall.SIGKILL)
		}
		cmd.Wait()
	}()
	testenv.WaitFor(t, "the pidfile", func() bool { return readPid(pidfile) == pids[0] })

	const clients, upgrades = 16, 6
	var st loadStats
	var sent, closed atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	chat := `{"messages":[{"role":"user","content":"hi"}]}`
	transports := make([]*http.Transport, clients)
	for i := range clients {
		tr := &http.Transport{MaxIdleConnsPerHost: 4}
		transports[i] = tr
		c := &http.Client{Timeout: 30 * time.Second, Transport: tr}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := 0; ; k++ {
				select {
				case <-stop:
					return
				default:
				}
				// A POST without Idempotency-Key: the client never sends
				// it again, so a lost one is a failure here.
				var body io.Reader = strings.NewReader(chat)
				if i%2 == 1 {
					body = io.MultiReader(body) // length unknown: chunked
				}
				req, _ := http.NewRequest("POST", fmt.Sprintf("http://%s/sessions/w0-%032x/v1/chat/completions", data, i*1000+k), body)
				sent.Add(1)
				resp, err := c.Do(req)
				if err != nil {
					st.fail("pooled client %d, request %d: %v", i, k, err)
				} else {
					b, err := io.ReadAll(resp.Body)
					resp.Body.Close()
					if err != nil || resp.StatusCode != 200 || !strings.Contains(string(b), "chat.completion") {
						st.fail("pooled client %d, request %d: %d %v %.80q", i, k, resp.StatusCode, err, b)
					} else {
						st.ok.Add(1)
						if resp.Close {
							closed.Add(1) // answered by a retiring tetherd
						}
					}
				}
				// The session's pause between two requests (the
				// workload, not a wait for an event): 0.8 to 1.3 s,
				// around the second an idle connection was given
				// before.
				time.Sleep(time.Duration(800+(i*137+k*311)%500) * time.Millisecond)
			}
		}()
	}
	testenv.WaitFor(t, "every client through the first tetherd", func() bool { return st.ok.Load() >= clients || st.failed.Load() > 0 })
	for u := 0; u < upgrades; u++ {
		old := pids[len(pids)-1]
		syscall.Kill(old, syscall.SIGUSR2)
		testenv.WaitForWithin(t, "the new tetherd in the pidfile", time.Minute, func() bool {
			p := readPid(pidfile)
			return p != 0 && p != old
		})
		pids = append(pids, readPid(pidfile))
		// Every client sends about once more before the next upgrade,
		// most over a connection pooled before this one.
		before := sent.Load()
		testenv.WaitForWithin(t, "requests after the upgrade", time.Minute, func() bool { return sent.Load() >= before+clients })
	}
	close(stop)
	wg.Wait()
	// The clients go away: they close their pools, as a process exiting
	// does, and the old processes, answered, exit.
	for _, tr := range transports {
		tr.CloseIdleConnections()
	}
	for _, p := range pids[:len(pids)-1] {
		testenv.WaitForWithin(t, fmt.Sprintf("old tetherd %d to exit", p), time.Minute, func() bool { return !alive(p) })
	}
	t.Logf("%d upgrades, %d clients pausing 0.8-1.3 s between requests over pooled connections: %d sent, %d ok (%d of them answered with Connection: close by a retiring tetherd), %d failed",
		upgrades, clients, sent.Load(), st.ok.Load(), closed.Load(), st.failed.Load())
	if st.failed.Load() != 0 || st.ok.Load() != sent.Load() {
		t.Errorf("%d of %d requests failed, first: %q", st.failed.Load(), sent.Load(), st.errs)
	}
	// The retiring processes served the requests sent on the connections
	// pooled before their upgrade (each client had one when the first
	// upgrade came).
	if closed.Load() == 0 {
		t.Errorf("no request answered by a retiring tetherd: the pooled connections were not used across the upgrades")
	}
	syscall.Kill(pids[len(pids)-1], syscall.SIGTERM)
}

// After an upgrade the admin API is the new process's alone: the old one,
// kept alive by a client's idle keep-alive connection (it closes none
// before --idle-timeout), accepts no admin connection, so a worker added
// or a metric read then is the new process's.
func TestUpgradeAdminGoesToSuccessor(t *testing.T) {
	if testing.Short() {
		t.Skip("builds tetherd")
	}
	bin := build(t, t.TempDir(), "github.com/tether-rl/tether/cmd/tetherd")
	w, err := demo.Start("127.0.0.1:0", demo.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	pidfile := filepath.Join(t.TempDir(), "tetherd.pid")
	cmd := exec.Command(bin, "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--listeners", "2", "--bpf", "off",
		"--pidfile", pidfile, "--worker", w.URL(), "--idle-timeout", "10m")
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var logs logWatch
	go logs.run(stderr)
	data := logs.wait(t, `msg="tetherd serving" listen=(\S+)`)
	admin := logs.wait(t, `msg="admin API serving" admin=(\S+)`)
	old := cmd.Process.Pid
	pids := []int{old}
	defer func() {
		for _, p := range pids {
			syscall.Kill(p, syscall.SIGKILL)
		}
		cmd.Wait()
	}()
	testenv.WaitFor(t, "the pidfile", func() bool { return readPid(pidfile) == old })
	// A client's keep-alive connection, idle across the upgrade.
	c, err := net.Dial("tcp", data)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	fmt.Fprintf(c, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	if resp, err := http.ReadResponse(br, nil); err != nil || resp.StatusCode != 200 {
		t.Fatalf("before the upgrade: %v %v", resp, err)
	} else {
		io.Copy(io.Discard, resp.Body)
	}
	syscall.Kill(old, syscall.SIGUSR2)
	testenv.WaitForWithin(t, "the new tetherd in the pidfile", time.Minute, func() bool {
		p := readPid(pidfile)
		return p != 0 && p != old
	})
	pids = append(pids, readPid(pidfile))
	testenv.WaitFor(t, "the old tetherd retiring", func() bool { return logs.count(`msg="retiring: the admin API is the new tetherd's"`) > 0 })
	// Each on a connection of its own: the old process counted one upgrade
	// handed over, the new one none.
	fresh := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	for i := 0; i < 20; i++ {
		resp, err := fresh.Get("http://" + admin + "/metrics")
		if err != nil {
			t.Fatalf("admin request %d after the upgrade: %v", i, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !strings.Contains(string(b), `tether_upgrades_total{outcome="handed_over"} 0`) {
			t.Fatalf("admin request %d after the upgrade answered by the old process (%d %.200q)", i, resp.StatusCode, b)
		}
	}
	if !alive(old) {
		t.Fatalf("the old tetherd exited with a client's keep-alive connection open: nothing was checked")
	}
	// The client goes: the old process, left with nothing, exits.
	c.Close()
	testenv.WaitForWithin(t, "the old tetherd to exit", time.Minute, func() bool { return !alive(old) })
	syscall.Kill(pids[1], syscall.SIGTERM)
}

// A new binary that cannot start: the old tetherd keeps serving and says
// why; tetherctl upgrade reports the failure. With a good binary at the
// path again, tetherctl upgrade reports the new process.
func TestUpgradeFailsSafely(t *testing.T) {
	if testing.Short() {
		t.Skip("builds tetherd")
	}
	dir := t.TempDir()
	good := build(t, dir, "github.com/tether-rl/tether/cmd/tetherd")
	ctl := build(t, dir, "github.com/tether-rl/tether/cmd/tetherctl")
	live := filepath.Join(dir, "live", "tetherd")
	os.Mkdir(filepath.Dir(live), 0o755)
	place := func(src string) { // atomically, as a package manager does
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		tmp := live + ".new"
		if err := os.WriteFile(tmp, b, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, live); err != nil {
			t.Fatal(err)
		}
	}
	place(good)
	broken := filepath.Join(dir, "broken")
	os.WriteFile(broken, []byte("#!/bin/sh\necho 'cannot start' >&2\nexit 3\n"), 0o755)

	w, err := demo.Start("127.0.0.1:0", demo.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	pidfile := filepath.Join(dir, "tetherd.pid")
	cmd := exec.Command(live, "--listen", "127.0.0.1:0", "--admin", "off", "--bpf", "off", "--listeners", "1",
		"--pidfile", pidfile, "--worker", w.URL(), "--upgrade-timeout", "5s")
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var logs logWatch
	go logs.run(stderr)
	data := logs.wait(t, `msg="tetherd serving" listen=(\S+)`)
	first := cmd.Process.Pid
	defer func() {
		if p := readPid(pidfile); p != 0 {
			syscall.Kill(p, syscall.SIGKILL)
		}
		syscall.Kill(first, syscall.SIGKILL)
	}()
	testenv.WaitFor(t, "the pidfile", func() bool { return readPid(pidfile) == first })

	place(broken)
	out, err := exec.Command(ctl, "upgrade", "--pidfile", pidfile, "--timeout", "3s").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "upgrade failed") {
		t.Fatalf("tetherctl upgrade with a broken binary: %v %s", err, out)
	}
	logs.wait(t, `msg="upgrade failed: this process keeps serving"`)
	if readPid(pidfile) != first || !alive(first) {
		t.Fatal("the old tetherd did not keep serving")
	}
	resp, err := http.Get("http://" + data + "/health")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("after the failed upgrade: %v %v", resp, err)
	}
	resp.Body.Close()

	place(good)
	out, err = exec.Command(ctl, "upgrade", "--pidfile", pidfile).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "took over from "+strconv.Itoa(first)) {
		t.Fatalf("tetherctl upgrade: %v %s", err, out)
	}
	resp, err = http.Get("http://" + data + "/health")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("after the upgrade: %v %v", resp, err)
	}
	resp.Body.Close()
	syscall.Kill(readPid(pidfile), syscall.SIGTERM)
}

// listenDrops returns the kernel's counts of SYNs and handshakes its
// listeners dropped (TcpExt ListenOverflows, ListenDrops: an accept queue
// full, a request the listener could not take), for a failed dial's cause.
func listenDrops() string {
	b, err := os.ReadFile("/proc/net/netstat")
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(string(b), "\n")
	for i := 0; i+1 < len(lines); i += 2 {
		names, values := strings.Fields(lines[i]), strings.Fields(lines[i+1])
		if len(names) == 0 || names[0] != "TcpExt:" || len(values) != len(names) {
			continue
		}
		var out []string
		for k, n := range names {
			if n == "ListenOverflows" || n == "ListenDrops" {
				out = append(out, n+"="+values[k])
			}
		}
		return strings.Join(out, " ")
	}
	return "no TcpExt counters"
}
