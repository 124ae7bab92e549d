package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/daemon"
	"github.com/tether-rl/tether/userspace/demo"
	"github.com/tether-rl/tether/userspace/stats"
)

func build(t *testing.T, dir, pkg string) string {
	t.Helper()
	bin := filepath.Join(dir, filepath.Base(pkg))
	cmd := exec.Command("go", "build", "-o", bin, pkg)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build %s: %v\n%s", pkg, err, out)
	}
	return bin
}

// logWatch collects a process's stderr and finds lines in it.
type logWatch struct {
	mu    sync.Mutex
	lines []string
}

func (l *logWatch) run(r io.Reader) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		l.mu.Lock()
		l.lines = append(l.lines, sc.Text())
		l.mu.Unlock()
	}
}

// wait returns the first submatch of re in a line, waiting for it.
func (l *logWatch) wait(t *testing.T, re string) string {
	t.Helper()
	rx := regexp.MustCompile(re)
	deadline := time.Now().Add(30 * time.Second)
	for {
		l.mu.Lock()
		for _, line := range l.lines {
			if m := rx.FindStringSubmatch(line); m != nil {
				l.mu.Unlock()
				if len(m) > 1 {
					return m[1]
				}
				return m[0]
			}
		}
		l.mu.Unlock()
		if time.Now().After(deadline) {
			l.mu.Lock()
			defer l.mu.Unlock()
			t.Fatalf("no log line matching %q in:\n%s", re, strings.Join(l.lines, "\n"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// count returns how many lines match re.
func (l *logWatch) count(re string) int {
	rx := regexp.MustCompile(re)
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, line := range l.lines {
		if rx.MatchString(line) {
			n++
		}
	}
	return n
}

func children(ppid int) []int {
	var out []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		if len(f) > 2 && f[1] == strconv.Itoa(ppid) && f[0] != "Z" {
			out = append(out, pid)
		}
	}
	return out
}

func listURLs(t *testing.T, admin string) []string {
	t.Helper()
	resp, err := http.Get("http://" + admin + "/list_workers")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var l struct{ URLs []string }
	json.NewDecoder(resp.Body).Decode(&l)
	return l.URLs
}

// TestTetherdSpawnReloadStop runs the real binaries: tetherd --config FILE
// --spawn 2 -- tether-demo ...; SIGHUP applies a new worker list and
// refuses an invalid file; SIGTERM stops everything, leaving no process.
func TestTetherdSpawnReloadStop(t *testing.T) {
	if testing.Short() {
		t.Skip("builds binaries")
	}
	dir := t.TempDir()
	tetherd := build(t, dir, "github.com/tether-rl/tether/cmd/tetherd")
	demoBin := build(t, dir, "github.com/tether-rl/tether/cmd/tether-demo")
	extra, err := demo.Start("127.0.0.1:0", demo.Options{Index: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	cfg := filepath.Join(dir, "tetherd.json")
	os.WriteFile(cfg, []byte(`{"health-interval":"200ms","bad-session":"reject"}`), 0o600)

	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, tetherd, "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--bpf", "off",
		"--listeners", "1", "--config", cfg, "--spawn", "2", "--",
		demoBin, "--listen", "127.0.0.1:{port}", "--index", "{index}")
	stderr, _ := cmd.StderrPipe()
	cmd.Stdout = io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	var logs logWatch
	go logs.run(stderr)
	data := logs.wait(t, `msg="tetherd serving" listen=(\S+)`)
	admin := logs.wait(t, `msg="admin API serving" admin=(\S+)`)
	logs.wait(t, `msg="worker added" slot=0 .*origin=spawn`)
	logs.wait(t, `msg="worker added" slot=1 .*origin=spawn`)
	if u := listURLs(t, admin); len(u) != 2 {
		t.Fatalf("workers: %v", u)
	}
	kids := children(cmd.Process.Pid)
	if len(kids) != 2 {
		t.Fatalf("tetherd has %d children, want 2", len(kids))
	}
	resp, err := http.Post("http://"+data+"/sessions/w1-0123456789abcdef0123456789abcdef/v1/chat/completions", "application/json",
		strings.NewReader(`{"messages":[{"role":"user","content":"hi"}]}`))
	if err != nil || resp.StatusCode != 200 || resp.Header.Get("X-Tether-Demo-Worker") != "1" {
		t.Fatalf("chat through tetherd to spawned worker 1: %v %v", resp, err)
	}
	resp.Body.Close()

	// SIGHUP with a worker added to the file.
	os.WriteFile(cfg, []byte(fmt.Sprintf(`{"health-interval":"200ms","bad-session":"reject","worker":[%q]}`, extra.URL())), 0o600)
	cmd.Process.Signal(syscall.SIGHUP)
	logs.wait(t, `msg="worker added" slot=2 url=`+regexp.QuoteMeta(extra.URL()))
	// SIGHUP with an invalid file: refused, nothing changes.
	os.WriteFile(cfg, []byte(`{"health-interval":"soon"}`), 0o600)
	cmd.Process.Signal(syscall.SIGHUP)
	logs.wait(t, `msg="reload refused.*health-interval`)
	if u := listURLs(t, admin); len(u) != 3 {
		t.Fatalf("workers after a refused reload: %v", u)
	}

	cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("tetherd exit: %v", err)
	}
	for _, pid := range kids {
		if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); err == nil && !strings.Contains(string(b), ") Z ") {
			t.Errorf("spawned worker %d outlived tetherd: %s", pid, b)
		}
	}
}

// Out-of-range values are refused with the flag named, whether the command
// line or the config file gives them.
// A host with more CPUs than listener slots starts with default flags; an
// explicit count past the slots is refused with the bound.
func TestListenersFitBigHosts(t *testing.T) {
	for cpus, want := range map[int]int{1: 1, 2: 2, 64: 64, 65: 64, 384: 64} {
		if got := defaultListeners(cpus); got != want {
			t.Errorf("defaultListeners(%d) = %d, want %d", cpus, got, want)
		}
	}
	c, err := parse([]string{"--listen", "127.0.0.1:0"})
	if err != nil || c.opts.Listeners < 1 || c.opts.Listeners > stats.MaxSlots {
		t.Fatalf("default listeners: %v %v", c, err)
	}
	if _, err := parse([]string{"--listeners", strconv.Itoa(stats.MaxSlots + 1)}); err == nil || !strings.Contains(err.Error(), strconv.Itoa(stats.MaxSlots)) {
		t.Fatalf("--listeners %d: %v, want a refusal naming the bound", stats.MaxSlots+1, err)
	}
}

func TestBadValuesRefused(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "c.json")
	os.WriteFile(cfg, []byte(`{"listeners":0}`), 0o600)
	for _, tc := range []struct {
		args []string
		flag string
	}{
		{[]string{"--response-timeout=-1s"}, "response-timeout"},
		{[]string{"--splice-min=-1"}, "splice-min"},
		{[]string{"--max-tracked-requests=-5"}, "max-tracked-requests"},
		{[]string{"--listeners=0"}, "listeners"},
		{[]string{"--config", cfg}, "listeners"},
		{[]string{"--health-interval=-1s"}, "health-interval"},
		{[]string{"--remove-grace=0"}, "remove-grace"}, // the registry would take 0 as its default, a minute
		{[]string{"--shutdown-grace=-1s"}, "shutdown-grace"},
		{[]string{"--hash-load-factor=0.5"}, "hash-load-factor"},
		{[]string{"--sticky-ttl=-1s"}, "sticky-ttl"},
		{[]string{"--hash-spill-min=-1"}, "hash-spill-min"},
		{[]string{"--max-request-line=-1"}, "max-request-line"},
		{[]string{"--head-timeout=-1s"}, "head-timeout"},
		{[]string{"--hash-spill-ttl=-1s"}, "hash-spill-ttl"},
		{[]string{"--learn-session-path=sessions"}, "learn-session-path"},
		{[]string{"--learn-session-ttl=-1s"}, "learn-session-ttl"},
		{[]string{"--stream-idle-timeout=0"}, "stream-idle-timeout"}, // 0 would be the default, 5m
		{[]string{"--splice-min=0"}, "splice-min"},
		{[]string{"--max-queue=0"}, "max-queue"},
		{[]string{"--max-queue=-2"}, "max-queue"},
		{[]string{"--kv-veto=0"}, "kv-veto"},
		{[]string{"--peek-bytes=0"}, "peek-bytes"},
		{[]string{"--update-timeout=0"}, "update-timeout"},
		{[]string{"--cluster", "http://127.0.0.1:2379"}, "cluster"},
		{[]string{"--cluster-name", "x"}, "cluster"},
		{[]string{"--cluster", "etcd://127.0.0.1:2379", "--cluster-name", "a/b"}, "cluster-name"},
	} {
		args := append([]string{"--listen", "127.0.0.1:0", "--bpf", "off", "--demo", "1"}, tc.args...)
		c, err := parse(args)
		if err == nil {
			var d *daemon.Daemon
			if d, err = daemon.New(c.opts); err == nil {
				d.Shutdown(context.Background())
				t.Fatalf("%v accepted", tc.args)
			}
		}
		if !strings.Contains(err.Error(), "--"+tc.flag) {
			t.Errorf("%v: error %q does not name --%s", tc.args, err, tc.flag)
		}
	}
}
