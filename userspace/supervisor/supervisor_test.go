package supervisor

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/health"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/worker"
)

// The test binary doubles as the worker process (TETHER_SUP_HELPER=worker)
// and as a tetherd stand-in that supervises one (TETHER_SUP_HELPER=parent).
func TestMain(m *testing.M) {
	switch os.Getenv("TETHER_SUP_HELPER") {
	case "worker":
		helperWorker(os.Args[1:])
		return
	case "parent":
		helperParent()
		return
	}
	os.Exit(m.Run())
}

func helperWorker(args []string) {
	fs := flag.NewFlagSet("worker", flag.ExitOnError)
	listen := fs.String("listen", "", "")
	fd := fs.Int("fd", 0, "")
	index := fs.Int("index", -1, "")
	ignoreTerm := fs.Bool("ignore-term", false, "")
	grandchild := fs.Bool("grandchild", false, "")
	fs.Parse(args)
	var ln net.Listener
	var err error
	if *fd > 0 {
		ln, err = net.FileListener(os.NewFile(uintptr(*fd), "listener"))
	} else {
		ln, err = net.Listen("tcp", *listen)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		os.Exit(2)
	}
	var gpid int
	if *grandchild {
		c := exec.Command("sleep", "300")
		c.Start()
		gpid = c.Process.Pid
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM)
	go func() {
		for range sig {
			if !*ignoreTerm {
				os.Exit(0)
			}
		}
	}()
	http.Serve(ln, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/health":
			fmt.Fprintf(w, `{"status":"ok","index":%d}`, *index)
		case "/pid":
			fmt.Fprintf(w, "%d %d", os.Getpid(), gpid)
		default:
			http.NotFound(w, r)
		}
	}))
}

// helperParent supervises one worker, prints its pid, and waits to be
// killed.
func helperParent() {
	s, err := New(Options{Config: Config{N: 1, Command: workerCmd("--listen", "127.0.0.1:{port}")}, Probe: health.NewProber(time.Second),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Stdout: io.Discard, Stderr: io.Discard})
	if err != nil {
		fmt.Println("error", err)
		os.Exit(1)
	}
	s.Start()
	for {
		if p := s.Procs()[0]; p.Ready {
			fmt.Println("child", p.PID, p.URL)
			break
		}
		// A helper process has no testing.T for testenv.WaitFor: it polls,
		// and the test waits (bounded) for the line it prints.
		time.Sleep(10 * time.Millisecond)
	}
	select {}
}

func workerCmd(args ...string) []string {
	return append([]string{"env", "TETHER_SUP_HELPER=worker", os.Args[0]}, args...)
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func newSup(t *testing.T, n int, reg *registry.Registry, args ...string) *Supervisor {
	t.Helper()
	s, err := New(Options{Config: Config{N: n, Command: workerCmd(args...), Grace: 2 * time.Second}, Probe: health.NewProber(time.Second), Registry: reg,
		BackoffMin: 20 * time.Millisecond, StartupTimeout: 20 * time.Second,
		Stdout: io.Discard, Stderr: os.Stderr, Log: quiet})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func getPIDs(t *testing.T, url string) (pid, gpid int) {
	t.Helper()
	resp, err := http.Get(url + "/pid")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	fmt.Sscan(string(b), &pid, &gpid)
	return pid, gpid
}

// alive reports whether pid is a live process (a zombie is not: it holds
// no port and no memory).
func alive(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}

// inGroup lists the live processes of process group pgid.
func inGroup(pgid int) []int {
	var out []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if g, err := syscall.Getpgid(pid); err == nil && g == pgid && alive(pid) {
			out = append(out, pid)
		}
	}
	return out
}

func portFree(t *testing.T, url string) bool {
	ln, err := net.Listen("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		return false
	}
	ln.Close()
	return true
}

func TestValidation(t *testing.T) {
	p := health.NewProber(time.Second)
	for _, o := range []Options{{Config: Config{N: 0, Command: []string{"x"}}, Probe: p}, {Config: Config{N: 1}, Probe: p}, {Config: Config{N: 1, Command: []string{" "}}, Probe: p}, {Config: Config{N: 1, Command: []string{"x"}}}} {
		if _, err := New(o); err == nil {
			t.Errorf("%+v accepted", o)
		}
	}
}

// TestSpawnCrashRestartStop: N workers come up in slots 0..N-1 with
// distinct ports and {index}; one that crashes is restarted in the same
// slot on the same port; Stop leaves no process and frees every port.
func TestSpawnCrashRestartStop(t *testing.T) {
	reg := registry.New(registry.Options{Stats: stats.NewHeap(), Log: quiet})
	defer reg.Close()
	s := newSup(t, 3, reg, "--listen", "127.0.0.1:{port}", "--index", "{index}", "--grandchild")
	urls := s.URLs()
	for i, u := range urls {
		if err := reg.Reserve(i, u, registry.OriginSpawn); err != nil {
			t.Fatal(err)
		}
	}
	s.Start()
	stopped := false
	defer func() {
		if !stopped {
			s.Stop(context.Background())
		}
	}()
	testenv.WaitForWithin(t, "3 workers routable", 20*time.Second, func() bool {
		for i := 0; i < 3; i++ {
			if w := reg.Table().Get(i); w == nil || w.State() != worker.Healthy {
				return false
			}
		}
		return true
	})
	seen := map[string]bool{}
	var pids []int
	for i, u := range urls {
		if seen[u] {
			t.Fatalf("port given twice: %v", urls)
		}
		seen[u] = true
		resp, err := http.Get(u + "/health")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !strings.Contains(string(b), fmt.Sprintf(`"index":%d`, i)) {
			t.Fatalf("worker %d: %s", i, b)
		}
		pid, gpid := getPIDs(t, u)
		pids = append(pids, pid, gpid)
	}

	// Crash worker 1: unhealthy at once, then back in slot 1 on its port.
	pid1, _ := getPIDs(t, urls[1])
	syscall.Kill(pid1, syscall.SIGKILL)
	testenv.WaitForWithin(t, "slot 1 unhealthy", 20*time.Second, func() bool { return reg.Table().Get(1).State() == worker.Unhealthy })
	testenv.WaitForWithin(t, "slot 1 back", 20*time.Second, func() bool { return reg.Table().Get(1).State() == worker.Healthy })
	if got := reg.Table().Get(1).URL; got != urls[1] {
		t.Fatalf("restarted on %s, want %s", got, urls[1])
	}
	npid, ngpid := getPIDs(t, urls[1])
	if npid == pid1 {
		t.Fatal("same pid after a crash")
	}
	pids = append(pids, npid, ngpid)
	if p := s.Procs()[1]; p.Restarts != 1 || !p.Ready || p.PID != npid {
		t.Fatalf("procs: %+v", p)
	}

	start := time.Now()
	s.Stop(context.Background())
	stopped = true
	if time.Since(start) > 2*time.Second {
		t.Fatalf("stop took %v (workers exit on SIGTERM)", time.Since(start))
	}
	for _, pid := range pids {
		if pid > 0 && alive(pid) {
			t.Errorf("process %d still alive after Stop", pid)
		}
		if pid > 0 && len(inGroup(pid)) > 0 {
			t.Errorf("process group %d still has %v", pid, inGroup(pid))
		}
	}
	for _, u := range urls {
		if !portFree(t, u) {
			t.Errorf("port of %s still taken", u)
		}
	}
	for _, p := range s.Procs() {
		if p.Running || p.PID != 0 {
			t.Errorf("proc after stop: %+v", p)
		}
	}
}

// TestStopKillsAfterGrace: a worker that ignores SIGTERM is killed.
func TestStopKillsAfterGrace(t *testing.T) {
	s, err := New(Options{Config: Config{N: 1, Command: workerCmd("--listen", "127.0.0.1:{port}", "--ignore-term"), Grace: 300 * time.Millisecond},
		Probe: health.NewProber(time.Second), Stdout: io.Discard, Stderr: io.Discard, Log: quiet})
	if err != nil {
		t.Fatal(err)
	}
	s.Start()
	testenv.WaitForWithin(t, "ready", 20*time.Second, func() bool { return s.Procs()[0].Ready })
	pid, _ := getPIDs(t, s.URLs()[0])
	start := time.Now()
	s.Stop(context.Background())
	if d := time.Since(start); d < 300*time.Millisecond || d > 5*time.Second {
		t.Fatalf("stop took %v, want the grace (300ms)", d)
	}
	if alive(pid) {
		t.Fatal("worker survived SIGKILL")
	}
}

// TestFDHandover: with {fd} the worker gets the bound socket itself and
// keeps its port across restarts without any window.
func TestFDHandover(t *testing.T) {
	reg := registry.New(registry.Options{Stats: stats.NewHeap(), Log: quiet})
	defer reg.Close()
	s := newSup(t, 1, reg, "--fd", "{fd}")
	reg.Reserve(0, s.URLs()[0], registry.OriginSpawn)
	s.Start()
	defer s.Stop(context.Background())
	testenv.WaitForWithin(t, "ready", 20*time.Second, func() bool { w := reg.Table().Get(0); return w != nil && w.State() == worker.Healthy })
	pid, _ := getPIDs(t, s.URLs()[0])
	syscall.Kill(pid, syscall.SIGKILL)
	testenv.WaitForWithin(t, "restart", 20*time.Second, func() bool { p := s.Procs()[0]; return p.Ready && p.PID != pid })
	if npid, _ := getPIDs(t, s.URLs()[0]); npid == pid {
		t.Fatal("not restarted")
	}
}

// TestWorkersDieWithTetherd: a supervisor killed with SIGKILL (no chance
// to stop anything) still takes its workers with it (Pdeathsig).
func TestWorkersDieWithTetherd(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0])
	cmd.Env = append(os.Environ(), "TETHER_SUP_HELPER=parent")
	out, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var pid int
	var url string
	sc := bufio.NewScanner(out)
	if !sc.Scan() {
		cmd.Process.Kill()
		t.Fatal("parent printed nothing")
	}
	if _, err := fmt.Sscanf(sc.Text(), "child %d %s", &pid, &url); err != nil {
		cmd.Process.Kill()
		t.Fatalf("parent: %q", sc.Text())
	}
	if !alive(pid) {
		t.Fatal("child not running")
	}
	cmd.Process.Kill()
	cmd.Wait()
	testenv.WaitForWithin(t, "orphan worker to die", 20*time.Second, func() bool { return !alive(pid) })
	testenv.WaitForWithin(t, "port to be free", 20*time.Second, func() bool { return portFree(t, url) })
}
