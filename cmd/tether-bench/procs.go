package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// proc is one child process started in its own process group, so that
// stopping it also stops whatever it forked (nginx workers, helpers).
type proc struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	logFile *os.File
	done    chan struct{}
	waitErr error
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// logTail returns the last n bytes of the child's combined output.
func (p *proc) logTail(n int) string {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return ""
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return strings.TrimSpace(string(b))
}

// manager owns every child process and removes the temp dir on cleanup.
type manager struct {
	mu      sync.Mutex
	procs   []*proc
	tmp     string
	ports   map[int]bool
	closing bool
	keepTmp bool
	hooks   []func()
	noFile  int      // >0: processes start under ulimit -n noFile
	env     []string // extra environment for the processes started now

	cleanOnce sync.Once
}

// onCleanup registers f to run after every child has stopped.
func (m *manager) onCleanup(f func()) {
	m.mu.Lock()
	m.hooks = append(m.hooks, f)
	m.mu.Unlock()
}

func newManager(keepTmp bool) (*manager, error) {
	tmp, err := os.MkdirTemp("", "tether-bench-")
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(tmp, "logs"), 0o755); err != nil {
		return nil, err
	}
	return &manager{tmp: tmp, ports: map[int]bool{}, keepTmp: keepTmp}, nil
}

// start runs bin with args; output goes to logs/<name>.log.
func (m *manager) start(name, bin string, args ...string) (*proc, error) {
	m.mu.Lock()
	if m.closing {
		m.mu.Unlock()
		return nil, errors.New("shutting down")
	}
	m.mu.Unlock()
	logPath := filepath.Join(m.tmp, "logs", fmt.Sprintf("%s-%d.log", name, time.Now().UnixNano()))
	lf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	if m.noFile > 0 {
		// Under a descriptor limit (the soak's fd-limit scenario).
		args = append([]string{"-c", fmt.Sprintf(`ulimit -n %d && exec "$0" "$@"`, m.noFile), bin}, args...)
		bin = "/bin/sh"
	}
	cmd := exec.Command(bin, args...)
	if len(m.env) > 0 {
		cmd.Env = append(os.Environ(), m.env...)
	}
	cmd.Stdout = lf
	cmd.Stderr = lf
	cmd.Dir = m.tmp
	// Own process group (so the whole tree can be killed) and SIGKILL if
	// the harness itself dies without cleaning up.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		lf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, logPath: logPath, logFile: lf, done: make(chan struct{})}
	go func() {
		p.waitErr = cmd.Wait()
		lf.Close()
		close(p.done)
	}()
	m.mu.Lock()
	m.procs = append(m.procs, p)
	m.mu.Unlock()
	return p, nil
}

// stop sends SIGTERM to the process group, then SIGKILL after grace.
func (m *manager) stop(p *proc) {
	if p == nil {
		return
	}
	pgid := p.pid()
	if !p.exited() {
		_ = syscall.Kill(-pgid, syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(3 * time.Second):
			_ = syscall.Kill(-pgid, syscall.SIGKILL)
			select {
			case <-p.done:
			case <-time.After(2 * time.Second):
			}
		}
	}
	// Leftovers of the group (e.g. nginx workers whose master died).
	_ = syscall.Kill(-pgid, syscall.SIGKILL)
	m.mu.Lock()
	for i, q := range m.procs {
		if q == p {
			m.procs = append(m.procs[:i], m.procs[i+1:]...)
			break
		}
	}
	m.mu.Unlock()
}

// cleanup stops every child, runs the hooks and removes the temp dir.
// Safe to call from several goroutines: every caller returns only once the
// cleanup is complete.
func (m *manager) cleanup() {
	m.cleanOnce.Do(func() {
		m.mu.Lock()
		m.closing = true
		ps := append([]*proc(nil), m.procs...)
		m.mu.Unlock()
		var wg sync.WaitGroup
		for _, p := range ps {
			wg.Add(1)
			go func(p *proc) { defer wg.Done(); m.stop(p) }(p)
		}
		wg.Wait()
		for _, f := range m.hooks {
			f()
		}
		if m.keepTmp {
			fmt.Fprintf(os.Stderr, "tether-bench: kept temp dir %s\n", m.tmp)
			return
		}
		_ = os.RemoveAll(m.tmp)
	})
}

// freePort asks the kernel for a free loopback port and never hands the same
// port out twice in one run.
func (m *manager) freePort() (int, error) {
	for i := 0; i < 50; i++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		m.mu.Lock()
		used := m.ports[port]
		m.ports[port] = true
		m.mu.Unlock()
		if !used {
			return port, nil
		}
	}
	return 0, errors.New("no free port")
}

// startServer starts a server on a fresh port (retrying with another port if
// the child dies before it is healthy, e.g. a lost port race) and waits until
// GET healthPath answers 200.
func (m *manager) startServer(ctx context.Context, name, bin string, mkArgs func(port int) ([]string, error), healthPath string) (*proc, int, error) {
	var lastErr error
	for attempt := 0; attempt < 3; attempt++ {
		port, err := m.freePort()
		if err != nil {
			return nil, 0, err
		}
		args, err := mkArgs(port)
		if err != nil {
			return nil, 0, err
		}
		p, err := m.start(name, bin, args...)
		if err != nil {
			return nil, 0, err
		}
		err = waitHealthy(ctx, p, fmt.Sprintf("http://127.0.0.1:%d%s", port, healthPath), 15*time.Second)
		if err == nil {
			return p, port, nil
		}
		tail := p.logTail(2000)
		logf("%s failed to start: %s %s: %v\n--- log tail ---\n%s", name, bin, strings.Join(args, " "), err, tail)
		lastErr = fmt.Errorf("%s: %w; log: %s", name, err, lastLine(tail))
		m.stop(p)
		if ctx.Err() != nil {
			break
		}
	}
	return nil, 0, lastErr
}

var healthClient = &http.Client{
	Timeout:   time.Second,
	Transport: &http.Transport{Proxy: nil, DisableKeepAlives: true},
}

func waitHealthy(ctx context.Context, p *proc, url string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last string
	for time.Now().Before(deadline) {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if p.exited() {
			return fmt.Errorf("exited before healthy (%v)", p.waitErr)
		}
		resp, err := healthClient.Get(url)
		if err == nil {
			var buf bytes.Buffer
			_, _ = buf.ReadFrom(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return nil
			}
			last = fmt.Sprintf("status %d", resp.StatusCode)
		} else {
			last = err.Error()
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("not healthy after %v at %s (last: %s)", timeout, url, last)
}

func lastLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		s = s[i+1:]
	}
	if len(s) > 300 {
		s = s[:300] + "..."
	}
	return s
}
