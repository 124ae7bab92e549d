// Package supervisor runs tetherd's own worker processes (tetherd --spawn
// N -- CMD ARGS...): N session servers on loopback ports, one per worker
// slot 0..N-1, restarted in the same slot and port when they crash, and
// stopped with tetherd.
//
// Placeholders in CMD and ARGS: {index} (the slot, 0..N-1), {count} (N),
// {port}, {host} and {fd}. Ports are allocated by binding host:0 and kept
// bound until the moment the process starts, so two workers never get one
// port and the window in which another program could take it is the exec
// of the process. With {fd} in the command there is no window at all: the
// bound listening socket itself is handed to the process as file
// descriptor 3 ({fd} is "3"; LISTEN_FDS=1 is set too, but not LISTEN_PID)
// and kept open by tetherd across restarts, so connections queue while a
// crashed worker comes back.
//
// A process starts in its own process group (Setpgid) with
// Pdeathsig=SIGKILL, from one OS thread that lives as long as the
// processes do (Pdeathsig fires when the thread that forked exits), so the
// workers die with tetherd even if it is killed. Stop sends SIGTERM to
// every group, then SIGKILL after the grace period, and reaps everything:
// no orphan is left holding a port. A process that exits is reaped, the
// rest of its group killed, and it is started again after a backoff; if
// its port was taken meanwhile, it gets a new one and the registry follows.
package supervisor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/registry"
)

// DefaultGrace is Config.Grace's default (--spawn-grace).
const DefaultGrace = 10 * time.Second

// Config is the supervisor's settings (tetherd's --spawn N -- CMD and
// --spawn-grace), apart from the wiring (Options). Zero fields take the
// defaults (Provision); N 0 is no supervisor.
type Config struct {
	N       int      // processes; slots 0..N-1
	Command []string // program and arguments, with placeholders
	// Grace between SIGTERM and SIGKILL on Stop; DefaultGrace.
	Grace time.Duration
}

// DefaultConfig is Config with every field at its default (no process).
func DefaultConfig() Config {
	var c Config
	c.Provision()
	return c
}

// Provision fills c's zero (or negative) fields with the defaults.
func (c *Config) Provision() {
	if c.Grace <= 0 {
		c.Grace = DefaultGrace
	}
}

// errNoCommand: N processes of no command.
var errNoCommand = errors.New("--spawn: give the worker command after --, e.g. tetherd --spawn 2 -- tether-demo --listen 127.0.0.1:{port} --index {index}")

// Validate refuses out-of-range settings (zero is the default), naming
// tetherd's flag (settings, flags.go), and N processes of no command.
func (c Config) Validate() error {
	if err := config.Validate(c.settings()); err != nil {
		return err
	}
	if c.N > 0 && (len(c.Command) == 0 || strings.TrimSpace(c.Command[0]) == "") {
		return errNoCommand
	}
	return nil
}

// Options configure a Supervisor: its settings (Config) and wiring. Zero
// values take the defaults.
type Options struct {
	Config
	Host string // where the workers listen; default 127.0.0.1
	// StartupTimeout bounds the wait for a started process's /health;
	// default registry.DefaultStartupTimeout (tetherd passes
	// --worker-startup-timeout). A process that misses it is killed and restarted.
	StartupTimeout time.Duration
	// Backoff before a restart, doubling from BackoffMin (default 250ms)
	// to BackoffMax (default 30s); back to the minimum after a process ran
	// for a minute.
	BackoffMin, BackoffMax time.Duration
	// Probe checks a worker's /health (required).
	Probe registry.Prober
	// Registry gets the workers: Activate(slot) once healthy,
	// ForceHealth(slot, false) when the process exits. Optional.
	Registry *registry.Registry
	// Stdout and Stderr of the processes; default tetherd's stderr.
	Stdout, Stderr io.Writer
	Log            *slog.Logger
}

// Placeholders recognized in the command.
var placeholders = []string{"{index}", "{count}", "{port}", "{host}", "{fd}"}

// proc is one supervised process (one slot).
type proc struct {
	index int
	port  int
	url   string
	ln    *net.TCPListener // held until the process starts ({fd}: always)

	// guarded by Supervisor.mu
	cmd      *exec.Cmd
	pid      int
	running  bool
	restarts int
	ready    bool
}

// Supervisor runs the worker processes.
type Supervisor struct {
	opts   Options
	log    *slog.Logger
	procs  []*proc
	fdMode bool

	spawnc chan spawnReq

	mu       sync.Mutex
	started  bool
	stopping bool
	stopc    chan struct{}
	wg       sync.WaitGroup
}

type spawnReq struct {
	cmd     *exec.Cmd
	release func() // closes the port's listener just before the start
	done    chan error
}

// New checks the options and binds the N ports (released when each
// process starts). Start launches the processes.
func New(opts Options) (*Supervisor, error) {
	if opts.N <= 0 {
		return nil, fmt.Errorf("--spawn %d: want at least 1", opts.N)
	}
	if err := opts.Config.Validate(); err != nil {
		return nil, err
	}
	if opts.Probe == nil {
		return nil, errors.New("supervisor: no health prober")
	}
	if opts.Host == "" {
		opts.Host = "127.0.0.1"
	}
	opts.Config.Provision()
	if opts.StartupTimeout <= 0 {
		opts.StartupTimeout = registry.DefaultStartupTimeout
	}
	if opts.BackoffMin <= 0 {
		opts.BackoffMin = 250 * time.Millisecond
	}
	if opts.BackoffMax < opts.BackoffMin {
		opts.BackoffMax = max(30*time.Second, opts.BackoffMin)
	}
	if opts.Stdout == nil {
		opts.Stdout = os.Stderr
	}
	if opts.Stderr == nil {
		opts.Stderr = os.Stderr
	}
	if opts.Log == nil {
		opts.Log = slog.Default()
	}
	joined := strings.Join(opts.Command, " ")
	s := &Supervisor{opts: opts, log: opts.Log, stopc: make(chan struct{}),
		fdMode: strings.Contains(joined, "{fd}")}
	if !s.fdMode && !strings.Contains(joined, "{port}") {
		s.log.Warn("--spawn command has no {port} (nor {fd}) placeholder: the workers cannot know the port tetherd checks", "command", joined)
	}
	for i := 0; i < opts.N; i++ {
		ln, err := s.bind(0)
		if err != nil {
			s.closeListeners()
			return nil, fmt.Errorf("--spawn: allocate a port on %s: %w", opts.Host, err)
		}
		p := &proc{index: i, ln: ln, port: ln.Addr().(*net.TCPAddr).Port}
		p.url = "http://" + net.JoinHostPort(opts.Host, strconv.Itoa(p.port))
		s.procs = append(s.procs, p)
	}
	return s, nil
}

func (s *Supervisor) bind(port int) (*net.TCPListener, error) {
	lc := net.ListenConfig{}
	lc.SetMultipathTCP(false)
	ln, err := lc.Listen(context.Background(), "tcp", net.JoinHostPort(s.opts.Host, strconv.Itoa(port)))
	if err != nil {
		return nil, err
	}
	return ln.(*net.TCPListener), nil
}

// URLs returns the workers' urls, index = slot.
func (s *Supervisor) URLs() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, len(s.procs))
	for i, p := range s.procs {
		out[i] = p.url
	}
	return out
}

// ProcInfo describes one process.
type ProcInfo struct {
	Index    int    `json:"index"`
	URL      string `json:"url"`
	PID      int    `json:"pid"` // 0 while not running
	Running  bool   `json:"running"`
	Ready    bool   `json:"ready"`
	Restarts int    `json:"restarts"`
}

// Procs describes the processes.
func (s *Supervisor) Procs() []ProcInfo {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]ProcInfo, len(s.procs))
	for i, p := range s.procs {
		out[i] = ProcInfo{Index: p.index, URL: p.url, Running: p.running, Ready: p.ready, Restarts: p.restarts}
		if p.running {
			out[i].PID = p.pid
		}
	}
	return out
}

// Start launches the processes; each is registered once its /health
// answers.
func (s *Supervisor) Start() {
	s.mu.Lock()
	if s.started || s.stopping {
		s.mu.Unlock()
		return
	}
	s.started = true
	s.mu.Unlock()
	s.spawnc = make(chan spawnReq)
	ready := make(chan struct{})
	go s.spawner(ready)
	<-ready
	for _, p := range s.procs {
		s.wg.Add(1)
		go s.run(p)
	}
}

// spawner starts every process from one locked OS thread that outlives
// them: Pdeathsig is tied to the thread that forked, not to the process.
func (s *Supervisor) spawner(ready chan<- struct{}) {
	runtime.LockOSThread()
	// Never unlocked: when this goroutine returns (after Stop reaped every
	// process) its thread exits with it.
	close(ready)
	for req := range s.spawnc {
		if req.release != nil {
			req.release()
		}
		req.done <- req.cmd.Start()
	}
}

var errStopping = errors.New("supervisor stopping")

func (s *Supervisor) expand(p *proc) []string {
	r := strings.NewReplacer("{index}", strconv.Itoa(p.index), "{count}", strconv.Itoa(s.opts.N),
		"{port}", strconv.Itoa(p.port), "{host}", s.opts.Host, "{fd}", "3")
	out := make([]string, len(s.opts.Command))
	for i, a := range s.opts.Command {
		out[i] = r.Replace(a)
	}
	return out
}

// launch starts p's process and returns a channel closed when it exited
// (with its Wait error stored in *exitErr).
func (s *Supervisor) launch(p *proc, exitErr *error) (<-chan struct{}, error) {
	args := s.expand(p)
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdout, cmd.Stderr = s.opts.Stdout, s.opts.Stderr
	cmd.Env = append(os.Environ(),
		"TETHER_WORKER_INDEX="+strconv.Itoa(p.index),
		"TETHER_WORKER_COUNT="+strconv.Itoa(s.opts.N),
		"TETHER_WORKER_PORT="+strconv.Itoa(p.port))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	var release func()
	var file *os.File
	if s.fdMode {
		f, err := p.ln.File()
		if err != nil {
			return nil, fmt.Errorf("listener fd: %w", err)
		}
		file = f
		cmd.ExtraFiles = []*os.File{f}
		cmd.Env = append(cmd.Env, "LISTEN_FDS=1")
	} else if ln := p.ln; ln != nil {
		p.ln = nil
		release = func() { ln.Close() }
	}
	s.mu.Lock()
	if s.stopping {
		s.mu.Unlock()
		if release != nil {
			release()
		}
		if file != nil {
			file.Close()
		}
		return nil, errStopping
	}
	done := make(chan error, 1)
	s.spawnc <- spawnReq{cmd: cmd, release: release, done: done}
	err := <-done
	if file != nil {
		file.Close()
	}
	if err != nil {
		s.mu.Unlock()
		return nil, err
	}
	p.cmd, p.pid, p.running, p.ready = cmd, cmd.Process.Pid, true, false
	s.mu.Unlock()
	exited := make(chan struct{})
	go func() {
		err := cmd.Wait()
		// Whatever the process left in its group goes with it.
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		s.mu.Lock()
		p.running = false
		p.ready = false
		s.mu.Unlock()
		*exitErr = err
		close(exited)
	}()
	return exited, nil
}

// run keeps p's process running until Stop.
func (s *Supervisor) run(p *proc) {
	defer s.wg.Done()
	backoff := s.opts.BackoffMin
	for attempt := 0; ; attempt++ {
		if attempt > 0 {
			if !s.sleep(backoff) {
				return
			}
			backoff = min(2*backoff, s.opts.BackoffMax)
			if !s.fdMode && !s.ensurePort(p) {
				continue
			}
			s.mu.Lock()
			p.restarts++
			s.mu.Unlock()
		}
		var exitErr error
		exited, err := s.launch(p, &exitErr)
		if errors.Is(err, errStopping) {
			return
		}
		if err != nil {
			s.log.Error("worker process did not start", "slot", p.index, "command", s.opts.Command[0], "err", err)
			continue
		}
		began := time.Now()
		s.log.Info("worker process started", "slot", p.index, "pid", p.cmd.Process.Pid, "url", p.url)
		s.awaitReady(p, exited)
		<-exited
		if s.isStopping() {
			return
		}
		if time.Since(began) > time.Minute {
			backoff = s.opts.BackoffMin
		}
		s.log.Warn("worker process exited", "slot", p.index, "pid", p.cmd.Process.Pid, "status", exitStatus(exitErr), "restart_in", backoff)
		if s.opts.Registry != nil {
			s.opts.Registry.ForceHealth(p.index, false, "process exited: "+exitStatus(exitErr))
		}
	}
}

// awaitReady probes p until it answers (then registers it), exits, the
// startup timeout passes (then kills it) or Stop.
func (s *Supervisor) awaitReady(p *proc, exited <-chan struct{}) {
	ctx, cancel := context.WithTimeout(context.Background(), s.opts.StartupTimeout)
	defer cancel()
	delay := 20 * time.Millisecond
	for {
		pctx, pcancel := context.WithTimeout(ctx, 2*time.Second)
		err := s.opts.Probe(pctx, p.url)
		pcancel()
		if err == nil {
			s.mu.Lock()
			p.ready = p.running
			s.mu.Unlock()
			s.log.Info("worker process ready", "slot", p.index, "url", p.url)
			if s.opts.Registry != nil {
				if err := s.opts.Registry.Activate(p.index); err != nil {
					s.log.Warn("worker not registered", "slot", p.index, "err", err)
				}
			}
			return
		}
		t := time.NewTimer(delay)
		select {
		case <-exited:
			t.Stop()
			return
		case <-s.stopc:
			t.Stop()
			return
		case <-ctx.Done():
			t.Stop()
			s.log.Warn("worker process not ready in time: killing it", "slot", p.index, "timeout", s.opts.StartupTimeout, "err", err)
			s.kill(p, syscall.SIGKILL)
			return
		case <-t.C:
		}
		delay = min(2*delay, time.Second)
	}
}

// ensurePort makes sure p's port can be bound again before a restart (and
// holds it until then); if it stays taken, p moves to a new port.
func (s *Supervisor) ensurePort(p *proc) bool {
	for i := 0; i < 5; i++ {
		if ln, err := s.bind(p.port); err == nil {
			p.ln = ln
			return true
		}
		if !s.sleep(100 * time.Millisecond) {
			return false
		}
	}
	ln, err := s.bind(0)
	if err != nil {
		s.log.Error("worker process: no port", "slot", p.index, "err", err)
		return false
	}
	old := p.url
	s.mu.Lock()
	p.ln, p.port = ln, ln.Addr().(*net.TCPAddr).Port
	p.url = "http://" + net.JoinHostPort(s.opts.Host, strconv.Itoa(p.port))
	s.mu.Unlock()
	s.log.Warn("worker port taken by another program: moving the worker", "slot", p.index, "from", old, "to", p.url)
	if s.opts.Registry != nil {
		if err := s.opts.Registry.Retarget(p.index, p.url); err != nil {
			s.log.Warn("registry: worker not moved", "slot", p.index, "err", err)
		}
	}
	return true
}

func (s *Supervisor) sleep(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-s.stopc:
		return false
	case <-t.C:
		return true
	}
}

func (s *Supervisor) isStopping() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stopping
}

// kill signals p's process group.
func (s *Supervisor) kill(p *proc, sig syscall.Signal) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p.running && p.pid > 0 {
		syscall.Kill(-p.pid, sig)
	}
}

// Stop sends SIGTERM to every process group, SIGKILL to what is left after
// the grace period (or when ctx ends), and returns once every process was
// reaped.
func (s *Supervisor) Stop(ctx context.Context) {
	s.mu.Lock()
	if s.stopping {
		s.mu.Unlock()
		s.wg.Wait()
		return
	}
	s.stopping = true
	close(s.stopc)
	started := s.started
	n := 0
	for _, p := range s.procs {
		if p.running && p.pid > 0 {
			syscall.Kill(-p.pid, syscall.SIGTERM)
			n++
		}
	}
	s.mu.Unlock()
	if n > 0 {
		s.log.Info("stopping worker processes", "processes", n, "grace", s.opts.Grace)
	}
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	t := time.NewTimer(s.opts.Grace)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	case <-ctx.Done():
	}
	select {
	case <-done:
	default:
		s.mu.Lock()
		for _, p := range s.procs {
			if p.running && p.pid > 0 {
				s.log.Warn("worker process did not stop in time: SIGKILL", "slot", p.index, "pid", p.pid)
				syscall.Kill(-p.pid, syscall.SIGKILL)
			}
		}
		s.mu.Unlock()
		<-done
	}
	if started {
		close(s.spawnc) // every process is reaped: the spawner thread may go
	}
	s.closeListeners()
}

func (s *Supervisor) closeListeners() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.procs {
		if p.ln != nil {
			p.ln.Close()
			p.ln = nil
		}
	}
}

func exitStatus(err error) string {
	if err == nil {
		return "exit status 0"
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return "signal: " + ws.Signal().String() // "signal: killed", as os/exec says
		}
	}
	return err.Error()
}
