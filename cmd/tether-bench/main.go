// Command tether-bench measures tetherd against a direct connection to a
// demo worker, nginx and haproxy on this machine: keep-alive request rate,
// p99 latency and proxy CPU per request (wrk), large body throughput and
// proxy CPU per GB (Go client), BPF steering on/off, and listener balance.
// Everything it starts runs in its own process group on loopback and is
// stopped on exit or signal. See bench/README.md.
package main

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

var allTargets = []string{"direct", "tetherd", "tetherd-nobpf", "nginx", "haproxy", "caddy", "gnet-exp"}

type options struct {
	dur          time.Duration
	warmup       time.Duration
	runs         int
	conns        int
	threads      int
	only         map[string]bool
	phases       map[string]bool
	bodyMB       int
	bodyN        int
	bodyDur      time.Duration
	repo         string
	out          string
	keepTmp      bool
	standin      bool
	mountBpffs   bool
	balanceL     int
	ctlArgs      []string
	tetherdExtra []string
	soakGB       int
	soakOnly     map[string]bool
}

// durationFlag accepts "5", "5s", "1500ms".
type durationFlag struct{ d *time.Duration }

func (f durationFlag) String() string {
	if f.d == nil {
		return ""
	}
	return f.d.String()
}
func (f durationFlag) Set(s string) error {
	if n, err := strconv.ParseFloat(s, 64); err == nil {
		*f.d = time.Duration(n * float64(time.Second))
		return nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	*f.d = d
	return nil
}

func splitSet(s string) map[string]bool {
	m := map[string]bool{}
	for _, x := range strings.Split(s, ",") {
		if x = strings.TrimSpace(x); x != "" {
			m[x] = true
		}
	}
	return m
}

func parseFlags() options {
	var o options
	o.dur = 5 * time.Second
	o.warmup = time.Second
	o.bodyDur = 2 * time.Second
	var only, phases, ctl, extra string
	flag.Var(durationFlag{&o.dur}, "d", "wrk duration per measured run (seconds or Go duration)")
	flag.Var(durationFlag{&o.warmup}, "warmup", "unmeasured wrk warm-up before each run (0 to skip)")
	flag.IntVar(&o.runs, "runs", 5, "interleaved runs per target (median reported; 5: on a noisy 2-core machine the ratios of 3-run medians swing by ±0.05)")
	flag.IntVar(&o.conns, "conns", 64, "wrk connections")
	flag.IntVar(&o.threads, "threads", 2, "wrk threads")
	flag.StringVar(&only, "only", "", "comma list of targets: "+strings.Join(allTargets, ",")+" (direct, the baseline, always runs)")
	flag.StringVar(&phases, "phases", "rps,newconn,bodies,balance,restart,scaling,latency,pd", "comma list of phases to run (also: soak, the overload and fault scenarios of make soak)")
	flag.IntVar(&o.soakGB, "soak-gb", 8, "body size in GiB for the soak's big-body scenario")
	var soakOnly string
	flag.StringVar(&soakOnly, "soak-only", "", "comma list of soak scenarios to run (slowloris, idle, slow readers, big bodies, fd limit); default all")
	flag.IntVar(&o.bodyMB, "body-mb", 16, "body size in MiB for the upload/download phase")
	flag.IntVar(&o.bodyN, "body-n", 1000, "max transfers per target and direction (the time bound -body-d usually ends first)")
	flag.Var(durationFlag{&o.bodyDur}, "body-d", "max time per target, direction and run")
	flag.StringVar(&o.repo, "repo", "", "repository root (default: found from the working directory)")
	flag.StringVar(&o.out, "out", "", "markdown results file (default <repo>/bench/results-latest.md, '-' for none)")
	flag.BoolVar(&o.keepTmp, "keep", false, "keep the temp dir (configs, logs) for inspection")
	flag.BoolVar(&o.mountBpffs, "mount-bpffs", true, "as root, mount a private bpffs in the temp dir for tetherd's pinned maps (unmounted at exit; /sys/fs/bpf is never touched)")
	flag.BoolVar(&o.standin, "standin", false, "use the built-in stand-in worker instead of tether-demo")
	flag.IntVar(&o.balanceL, "balance-listeners", 8, "tetherd --listeners for the balance figure")
	flag.StringVar(&ctl, "tetherctl-args", "", "extra args for 'tetherctl status --json' (space separated)")
	flag.StringVar(&extra, "tetherd-args", "", "extra args for every tetherd (space separated)")
	flag.Parse()
	o.only = splitSet(only)
	for t := range o.only {
		if !contains(allTargets, t) {
			fmt.Fprintf(os.Stderr, "tether-bench: unknown target %q (want %s)\n", t, strings.Join(allTargets, ","))
			os.Exit(2)
		}
	}
	o.phases = splitSet(phases)
	if soakOnly != "" {
		o.soakOnly = map[string]bool{}
		for _, x := range strings.Split(soakOnly, ",") {
			o.soakOnly[strings.TrimSpace(x)] = true
		}
	}
	o.ctlArgs = strings.Fields(ctl)
	o.tetherdExtra = strings.Fields(extra)
	if o.runs < 1 || o.conns < 1 || o.threads < 1 || o.bodyMB < 1 || o.dur < time.Second {
		fmt.Fprintln(os.Stderr, "tether-bench: -runs, -conns, -threads, -body-mb must be >= 1 and -d >= 1s")
		os.Exit(2)
	}
	return o
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "[%s] "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "standin-worker" {
		runStandinWorker(os.Args[2:])
		return
	}
	if len(os.Args) > 1 && os.Args[1] == "fakepd-fleet" {
		runFakePDFleet(os.Args[2:])
		return
	}
	o := parseFlags()
	os.Exit(run(o))
}

func findRepo() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && strings.Contains(string(b), "module github.com/tether-rl/tether") {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("not inside the tether repository (use -repo)")
		}
		dir = parent
	}
}

// goBuild builds ./cmd/<name> of the repo into binDir.
func goBuild(ctx context.Context, repo, binDir, name string) (string, error) {
	out := filepath.Join(binDir, name)
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, "./cmd/"+name)
	cmd.Dir = repo
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	b, err := cmd.CombinedOutput()
	if err != nil {
		msg := strings.TrimSpace(string(b))
		if len(msg) > 1500 {
			msg = msg[:1500] + "..."
		}
		return "", fmt.Errorf("go build ./cmd/%s: %v: %s", name, err, msg)
	}
	return out, nil
}

func sessionID(k int) string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("w%d-%s", k, hex.EncodeToString(b[:]))
}

func run(o options) (code int) {
	start := time.Now()
	if o.repo == "" {
		r, err := findRepo()
		if err != nil {
			logf("error: %v", err)
			return 2
		}
		o.repo = r
	}
	if o.out == "" {
		o.out = filepath.Join(o.repo, "bench", "results-latest.md")
	}
	m, err := newManager(o.keepTmp)
	if err != nil {
		logf("error: %v", err)
		return 1
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	defer m.cleanup()

	// Signals: stop everything and leave with 130.
	sigc := make(chan os.Signal, 1)
	signal.Notify(sigc, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	go func() {
		s := <-sigc
		logf("got %v: stopping all children", s)
		cancel()
		m.cleanup()
		os.Exit(130)
	}()
	// If whoever started us (make, go run) dies, stop too.
	go func(ppid int) {
		for range time.Tick(time.Second) {
			if os.Getppid() != ppid {
				logf("parent %d went away: stopping all children", ppid)
				cancel()
				m.cleanup()
				os.Exit(130)
			}
		}
	}(os.Getppid())
	// Watchdog: the harness never runs unbounded.
	nt := len(allTargets)
	budget := time.Duration(o.runs*nt)*(o.dur+o.warmup+3*time.Second) +
		time.Duration(len(bodyDirs)*nt*o.runs)*(o.bodyDur+20*time.Second) + o.dur + 10*time.Minute
	if o.phases["soak"] {
		budget += 15*time.Minute + time.Duration(o.soakGB)*30*time.Second
	}
	watchdog := time.AfterFunc(budget, func() {
		logf("watchdog: harness exceeded %v, killing everything", budget)
		m.cleanup()
		os.Exit(3)
	})
	defer watchdog.Stop()

	b := &bench{o: o, m: m, ctx: ctx}
	code = b.main()
	logf("done in %v", time.Since(start).Round(time.Second))
	return code
}

type bench struct {
	o   options
	m   *manager
	ctx context.Context

	wrkBin       string
	tetherdBin   string
	tetherdErr   string
	tetherdFlags map[string]bool
	loadStart    string
	bpffsNote    string
	steerNote    string // whether default tetherd had its BPF maps pinned
	pinDir       string // base of the per-instance pin dirs ("" = tetherd's default)
	pinSeq       int
	ctlBin       string
	ctlErr       string
	demoBin      string
	demoNote     string
	nginxBin     string
	haproxyBin   string
	caddyBin     string
	caddyErr     string
	gnetBin      string
	gnetErr      string

	workerPorts []int
	workerProcs []*proc
	ids         [][]string // per worker session ids

	soaking bool // the soak phase runs: tetherd gets --head-timeout like nginx's client_header_timeout
	targets []*target
	failed  bool // a target that should run could not start
	notes   []string
}

type target struct {
	name     string
	skip     string // why not run (not installed, excluded)
	broken   string // failed to start during the bench
	start    func() (*instance, error)
	rps      []rpsSample
	rpsNew   []rpsSample // a new connection per request (phase newconn)
	ups      []bodyResult
	downs    []bodyResult
	chunkeds []bodyResult // download, chunked
	up       bodySum
	down     bodySum
	chunked  bodySum
	hasBody  bool
	logNote  string
}

type instance struct {
	port   int
	pinDir string // tetherd's --bpf-pin-dir, if any
	procs  []*proc
	stop   func()
}

func (in *instance) pids() []int {
	var p []int
	for _, x := range in.procs {
		p = append(p, x.pid())
	}
	return p
}

type rpsSample struct {
	run                 int
	rps                 float64
	p50, p99            time.Duration
	requests            int64
	cpuUsPerReq         float64 // proxy; NaN-free: -1 when n/a
	syscallsPerReq      float64 // proxy, counted by perf; -1 when n/a
	switchesPerReq      float64 // proxy context switches, by perf; -1 when n/a
	workerUsPerReq      float64
	errSocket, errState int64
}

func (b *bench) want(t string) bool {
	return t == "direct" || len(b.o.only) == 0 || b.o.only[t]
}

func (b *bench) setup() error {
	o := b.o
	var err error
	if b.wrkBin, err = exec.LookPath("wrk"); err != nil {
		return errors.New("wrk not installed (apt-get install -y wrk)")
	}
	binDir := filepath.Join(b.m.tmp, "bin")
	if err := os.MkdirAll(binDir, 0o755); err != nil {
		return err
	}
	// Demo workers.
	if o.standin {
		b.demoNote = "built-in stand-in worker (-standin)"
	} else {
		logf("building tether-demo")
		if b.demoBin, err = goBuild(b.ctx, o.repo, binDir, "tether-demo"); err != nil {
			return fmt.Errorf("%v\n(use -standin to bench against the built-in stand-in worker)", err)
		}
		b.demoNote = "tether-demo"
	}
	if b.want("tetherd") || b.want("tetherd-nobpf") {
		logf("building tetherd")
		if b.tetherdBin, err = goBuild(b.ctx, o.repo, binDir, "tetherd"); err != nil {
			b.tetherdErr = err.Error()
			logf("!!! tetherd does not build: %v", err)
		} else {
			b.tetherdFlags = helpFlags(b.ctx, b.tetherdBin)
			b.pinDir, b.bpffsNote = setupPinDir(b.m, o.mountBpffs, b.tetherdFlags["bpf-pin-dir"])
			logf("bpffs: %s", b.bpffsNote)
		}
	}
	if o.phases["balance"] && b.want("tetherd") {
		if b.ctlBin, err = goBuild(b.ctx, o.repo, binDir, "tetherctl"); err != nil {
			b.ctlErr = "tetherctl does not build"
			b.ctlBin = ""
		}
	}
	b.nginxBin, _ = exec.LookPath("nginx")
	if b.nginxBin == "" {
		for _, p := range []string{"/usr/sbin/nginx", "/usr/local/sbin/nginx"} {
			if _, err := os.Stat(p); err == nil {
				b.nginxBin = p
			}
		}
	}
	if b.want("caddy") {
		logf("building caddy %s in its own module (cached; the first time takes minutes)", caddyVersion)
		if b.caddyBin, err = buildCaddy(b.ctx); err != nil {
			b.caddyErr = err.Error()
			logf("!!! caddy: %v", err)
		}
	}
	if b.want("gnet-exp") {
		logf("building gnet-exp (gnet %s) in its own module (cached)", gnetVersion)
		if b.gnetBin, err = buildGnet(b.ctx); err != nil {
			b.gnetErr = err.Error()
			logf("!!! gnet-exp: %v", err)
		}
	}
	b.haproxyBin, _ = exec.LookPath("haproxy")
	if b.haproxyBin == "" {
		if _, err := os.Stat("/usr/sbin/haproxy"); err == nil {
			b.haproxyBin = "/usr/sbin/haproxy"
		}
	}

	// Start 4 workers.
	for k := 0; k < 4; k++ {
		k := k
		bin, pre := b.demoBin, []string(nil)
		if o.standin {
			self, err := os.Executable()
			if err != nil {
				return err
			}
			bin, pre = self, []string{"standin-worker"}
		}
		p, port, err := b.m.startServer(b.ctx, fmt.Sprintf("worker%d", k), bin, func(port int) ([]string, error) {
			return append(append([]string(nil), pre...), "--listen", fmt.Sprintf("127.0.0.1:%d", port), "--index", strconv.Itoa(k)), nil
		}, "/health")
		if err != nil {
			return fmt.Errorf("demo worker %d: %w", k, err)
		}
		b.workerPorts = append(b.workerPorts, port)
		b.workerProcs = append(b.workerProcs, p)
		var ids []string
		for i := 0; i < 16; i++ {
			ids = append(ids, sessionID(k))
		}
		b.ids = append(b.ids, ids)
	}
	logf("workers up on ports %v (%s)", b.workerPorts, b.demoNote)

	// Targets.
	b.targets = append(b.targets, &target{name: "direct", start: func() (*instance, error) {
		return &instance{port: b.workerPorts[0], stop: func() {}}, nil
	}})
	addTetherd := func(name string, extra ...string) {
		t := &target{name: name}
		switch {
		case !b.want(name):
			t.skip = "excluded by -only"
		case b.tetherdBin == "":
			t.skip = "tetherd does not build"
			b.failed = true
		case len(extra) > 0 && strings.HasPrefix(extra[0], "--bpf") && !b.tetherdFlags["bpf"]:
			t.skip = "tetherd has NO --bpf FLAG yet: steering comparison not possible"
			logf("!!! %s", t.skip)
		default:
			t.start = func() (*instance, error) { return b.startTetherd(name, extra...) }
		}
		b.targets = append(b.targets, t)
	}
	addTetherd("tetherd")
	addTetherd("tetherd-nobpf", "--bpf=off")
	// An external proxy, when installed and not excluded.
	addExternal := func(name, bin string, start func() (*instance, error)) {
		t := &target{name: name}
		switch {
		case !b.want(name):
			t.skip = "excluded by -only"
		case bin == "":
			t.skip = name + " NOT INSTALLED (apt-get install -y " + name + ")"
			logf("!!! %s: skipping", t.skip)
		default:
			t.start = start
		}
		b.targets = append(b.targets, t)
	}
	addExternal("nginx", b.nginxBin, b.startNginx)
	addExternal("haproxy", b.haproxyBin, b.startHaproxy)
	if b.want("caddy") && b.caddyBin == "" && b.caddyErr != "" {
		b.targets = append(b.targets, &target{name: "caddy", skip: "caddy did not build: " + firstLine(b.caddyErr)})
	} else {
		addExternal("caddy", b.caddyBin, b.startCaddy)
	}
	if b.want("gnet-exp") && b.gnetBin == "" && b.gnetErr != "" {
		b.targets = append(b.targets, &target{name: "gnet-exp", skip: "gnet-exp did not build: " + firstLine(b.gnetErr)})
	} else {
		addExternal("gnet-exp", b.gnetBin, b.startGnet)
	}
	return nil
}

func (b *bench) workerURLs() []string {
	var args []string
	for _, p := range b.workerPorts {
		args = append(args, "--worker", fmt.Sprintf("http://127.0.0.1:%d", p))
	}
	return args
}

func (b *bench) startTetherd(name string, extra ...string) (*instance, error) {
	return b.startTetherdOn(name, append(b.workerURLs(), extra...))
}

// startTetherdOn starts a tetherd with the workers (and other flags) of
// workerArgs instead of the demo workers.
func (b *bench) startTetherdOn(name string, workerArgs []string) (*instance, error) {
	var pinDir string
	p, port, err := b.m.startServer(b.ctx, name, b.tetherdBin, func(port int) ([]string, error) {
		args := []string{"--listen", fmt.Sprintf("127.0.0.1:%d", port)}
		args = append(args, workerArgs...)
		if b.pinDir != "" {
			// A fresh pin dir per instance: counters in pinned maps
			// outlive a tetherd, and must not add up across instances.
			b.pinSeq++
			pinDir = filepath.Join(b.pinDir, fmt.Sprintf("%s-%d", name, b.pinSeq))
			if err := os.MkdirAll(b.pinDir, 0o700); err != nil {
				return nil, err
			}
			args = append(args, "--bpf-pin-dir", pinDir)
		}
		if b.tetherdFlags["admin"] {
			// The admin API defaults to a fixed port; the bench needs none.
			args = append(args, "--admin", "off")
		}
		if b.soaking {
			// As nginx's client_header_timeout and worker_connections
			// (under a descriptor limit, the default derived from it).
			args = append(args, "--head-timeout", soakHeadTimeout.String())
			if b.m.noFile == 0 {
				args = append(args, "--max-conns", "16384")
			}
		}
		if b.tetherdFlags["shutdown-grace"] {
			args = append(args, "--shutdown-grace", "2s")
		}
		return append(args, b.o.tetherdExtra...), nil
	}, "/health")
	if err != nil {
		return nil, err
	}
	return &instance{port: port, pinDir: pinDir, procs: []*proc{p}, stop: func() { b.m.stop(p) }}, nil
}

func (b *bench) startNginx() (*instance, error) {
	dir, err := os.MkdirTemp(b.m.tmp, "nginx-")
	if err != nil {
		return nil, err
	}
	pidFile := filepath.Join(dir, "nginx.pid")
	p, port, err := b.m.startServer(b.ctx, "nginx", b.nginxBin, func(port int) ([]string, error) {
		conf, err := nginxConfig(dir, port, b.workerPorts)
		if err != nil {
			return nil, err
		}
		return []string{"-e", "stderr", "-p", dir + "/", "-c", conf,
			"-g", fmt.Sprintf("daemon off; master_process on; pid %s; error_log stderr;", pidFile)}, nil
	}, "/health")
	if err != nil {
		return nil, err
	}
	return &instance{port: port, procs: []*proc{p}, stop: func() { b.m.stop(p) }}, nil
}

func (b *bench) startHaproxy() (*instance, error) {
	dir, err := os.MkdirTemp(b.m.tmp, "haproxy-")
	if err != nil {
		return nil, err
	}
	p, port, err := b.m.startServer(b.ctx, "haproxy", b.haproxyBin, func(port int) ([]string, error) {
		cfg, err := haproxyConfig(dir, port, b.workerPorts)
		if err != nil {
			return nil, err
		}
		return []string{"-db", "-f", cfg}, nil
	}, "/health")
	if err != nil {
		return nil, err
	}
	return &instance{port: port, procs: []*proc{p}, stop: func() { b.m.stop(p) }}, nil
}

// idsFor returns the session ids a target is driven with: worker 0's only
// for direct, else all workers' interleaved (w0, w1, w2, w3, w0, ...).
func (b *bench) idsFor(t *target) []string {
	if t.name == "direct" {
		return b.ids[0]
	}
	var out []string
	for i := range b.ids[0] {
		for k := range b.ids {
			out = append(out, b.ids[k][i])
		}
	}
	return out
}

func (b *bench) workerTicks() int64 {
	var pids []int
	for _, p := range b.workerProcs {
		pids = append(pids, p.pid())
	}
	return treeTicks(pids...)
}

// checkRouting sends one chat request per worker through the target and
// fails on a non-200 answer (a routing mistake shows up here, not as a
// fast stream of 404s in wrk).
func (b *bench) checkRouting(t *target, in *instance) error {
	client := newBodyClient()
	defer client.CloseIdleConnections()
	ids := b.idsFor(t)
	n := len(b.ids)
	if t.name == "direct" {
		n = 1
	}
	for i := 0; i < n; i++ {
		resp, err := client.Post(fmt.Sprintf("http://127.0.0.1:%d/sessions/%s/v1/chat/completions", in.port, ids[i]),
			"application/json", strings.NewReader(chatBody))
		if err != nil {
			return err
		}
		buf, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return fmt.Errorf("POST /sessions/%s/v1/chat/completions: status %d: %.300s", ids[i], resp.StatusCode, buf)
		}
	}
	return nil
}

func (b *bench) startTarget(t *target) (*instance, bool) {
	in, err := t.start()
	if err == nil {
		if err = b.checkRouting(t, in); err != nil {
			in.stop()
		}
	}
	if err != nil {
		if b.ctx.Err() != nil {
			return nil, false
		}
		t.broken = firstLine(err.Error())
		b.failed = true
		logf("!!! target %s cannot start: %v", t.name, err)
		return nil, false
	}
	return in, true
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	if len(s) > 400 {
		s = s[:400] + "..."
	}
	return s
}

func (b *bench) active(t *target) bool { return t.skip == "" && t.broken == "" }

// phaseRPS runs the keep-alive load, or with closeConn the load of a new
// connection per request.
func (b *bench) phaseRPS(closeConn bool) {
	o := b.o
	dir := b.m.tmp
	scripts := map[string]string{}
	suffix, label := "", "keep-alive"
	if closeConn {
		suffix, label = "-newconn", "new conn"
	}
	for _, t := range b.targets {
		s, err := writeWrkScript(dir, "wrk-"+t.name+suffix, b.idsFor(t), closeConn)
		if err != nil {
			logf("error: %v", err)
			b.failed = true
			return
		}
		scripts[t.name] = s
	}
	for run := 1; run <= o.runs; run++ {
		for _, t := range b.targets {
			if !b.active(t) || b.ctx.Err() != nil {
				continue
			}
			if closeConn && t.name == "gnet-exp" {
				continue // it proxies the keep-alive path only (no Connection: close)
			}
			in, ok := b.startTarget(t)
			if !ok {
				continue
			}
			if t.name == "tetherd" && b.steerNote == "" {
				b.steerNote = bpfPinned(in.pinDir)
			}
			url := fmt.Sprintf("http://127.0.0.1:%d", in.port)
			if o.warmup > 0 {
				_, _ = runWrk(b.ctx, b.wrkBin, url, scripts[t.name], o.threads, o.conns, o.warmup)
			}
			pids := in.pids()
			// System calls and context switches, counted by perf over the
			// middle of the measured run (not for direct: its process is
			// the worker).
			type counts struct {
				sys, cs, span float64
				ok            bool
			}
			perfc := make(chan counts, 1)
			if len(pids) > 0 && o.dur >= 2*time.Second {
				go func() {
					select {
					case <-time.After(500 * time.Millisecond):
					case <-b.ctx.Done():
					}
					span := o.dur - time.Second
					sys, cs, ok := perfCounts(b.ctx, pids, span)
					perfc <- counts{sys, cs, span.Seconds(), ok}
				}()
			} else {
				perfc <- counts{}
			}
			c0, w0 := treeTicks(pids...), b.workerTicks()
			res, err := runWrk(b.ctx, b.wrkBin, url, scripts[t.name], o.threads, o.conns, o.dur)
			c1, w1 := treeTicks(pids...), b.workerTicks()
			pc := <-perfc
			b.collectLogNote(t, in)
			in.stop()
			if err != nil {
				if b.ctx.Err() == nil {
					logf("!!! wrk against %s failed: %v", t.name, err)
					t.broken = "wrk failed"
					b.failed = true
				}
				continue
			}
			s := rpsSample{run: run, rps: res.rps, p50: res.p50, p99: res.p99, requests: res.requests,
				errSocket: res.errSocket, errState: res.errStatus, cpuUsPerReq: -1, syscallsPerReq: -1, switchesPerReq: -1}
			if pc.ok && res.rps > 0 {
				s.syscallsPerReq = pc.sys / (res.rps * pc.span)
				s.switchesPerReq = pc.cs / (res.rps * pc.span)
			}
			if res.requests > 0 {
				if len(pids) > 0 {
					s.cpuUsPerReq = float64(c1-c0) * (1e6 / clockTicks) / float64(res.requests)
				}
				s.workerUsPerReq = float64(w1-w0) * (1e6 / clockTicks) / float64(res.requests)
			}
			if closeConn {
				t.rpsNew = append(t.rpsNew, s)
			} else {
				t.rps = append(t.rps, s)
			}
			cpu := "n/a"
			if s.cpuUsPerReq >= 0 {
				cpu = fmt.Sprintf("%.1f", s.cpuUsPerReq)
			}
			logf("%s run %d/%d %-14s %9.0f req/s  p99 %-9v proxy CPU %s µs/req  syscalls %.2f/req  ctx switches %.2f/req  workers %.1f µs/req  errors %d/%d",
				label, run, o.runs, t.name, s.rps, s.p99, cpu, s.syscallsPerReq, s.switchesPerReq, s.workerUsPerReq, s.errSocket, s.errState)
		}
	}
}

// collectLogNote keeps the first tetherd log line that talks about BPF or
// steering, so the report says what mode "default" actually ran in.
func (b *bench) collectLogNote(t *target, in *instance) {
	if t.logNote != "" || !strings.HasPrefix(t.name, "tetherd") || len(in.procs) == 0 {
		return
	}
	data, err := os.ReadFile(in.procs[0].logPath)
	if err != nil {
		return
	}
	var serving string
	for _, line := range strings.Split(string(data), "\n") {
		l := strings.ToLower(line)
		if strings.Contains(l, "bpf") || strings.Contains(l, "steer") || strings.Contains(l, "reuseport") {
			serving = line
			break
		}
		if serving == "" && strings.Contains(l, "serving") {
			serving = line
		}
	}
	t.logNote = strings.TrimSpace(serving)
	if len(t.logNote) > 240 {
		t.logNote = t.logNote[:240] + "..."
	}
}

func (b *bench) phaseBodies() {
	o := b.o
	payload := make([]byte, o.bodyMB<<20)
	_, _ = rand.Read(payload)
	sum := sha256.Sum256(payload)
	want := hex.EncodeToString(sum[:])
	for run := 1; run <= o.runs; run++ {
		for _, t := range b.targets {
			if t.name == "gnet-exp" {
				continue // it proxies the keep-alive path only (whole messages in its buffers)
			}
			if !b.active(t) || b.ctx.Err() != nil {
				continue
			}
			in, ok := b.startTarget(t)
			if !ok {
				continue
			}
			pids := in.pids()
			cpu := func() int64 {
				if len(pids) == 0 {
					return 0
				}
				return treeTicks(pids...)
			}
			base := fmt.Sprintf("http://127.0.0.1:%d", in.port)
			ids := b.idsFor(t)
			up := bodyRun(b.ctx, base, ids, dirUpload, payload, want, o.bodyN, o.bodyDur, cpu)
			down := bodyRun(b.ctx, base, ids, dirDownload, payload, "", o.bodyN, o.bodyDur, cpu)
			// The chunked body must hash like the Content-Length one.
			chunked := bodyRun(b.ctx, base, ids, dirChunked, payload, down.digest, o.bodyN, o.bodyDur, cpu)
			in.stop()
			t.ups = append(t.ups, up)
			t.downs = append(t.downs, down)
			t.chunkeds = append(t.chunkeds, chunked)
			t.hasBody = true
			for _, r := range []struct {
				dir bodyDir
				r   bodyResult
			}{{dirUpload, up}, {dirDownload, down}, {dirChunked, chunked}} {
				if r.r.err != "" {
					logf("!!! %s %s: %s", t.name, r.dir, r.r.err)
				}
				if r.r.note != "" {
					logf("%s %s: %s", t.name, r.dir, r.r.note)
				}
				logf("run %d/%d %-14s %-17s %3d × %d MiB  %6.0f MB/s  proxy CPU %.3f s/GB",
					run, o.runs, t.name, r.dir, r.r.transfers, o.bodyMB, r.r.mbps(), r.r.cpuPerGB())
			}
			if chunked.chunks != nil {
				logf("run %d/%d %-14s chunks at the client: %s", run, o.runs, t.name, fmtChunks(chunked.chunks))
			}
		}
	}
	for _, t := range b.targets {
		if t.hasBody {
			t.up, t.down, t.chunked = sumBodies(t.ups), sumBodies(t.downs), sumBodies(t.chunkeds)
		}
	}
}

type balanceResult struct {
	ran      bool
	note     string
	actives  []int64
	accepted []int64
	states   []string
	rps      float64
}

func (b *bench) phaseBalance() balanceResult {
	var r balanceResult
	t := b.targetByName("tetherd")
	switch {
	case t == nil || t.skip != "" || t.broken != "":
		r.note = "skipped: tetherd not run"
		return r
	case b.ctlBin == "":
		r.note = "skipped: tetherctl not available (" + b.ctlErr + ")"
		return r
	}
	name := fmt.Sprintf("tetherd-l%d", b.o.balanceL)
	in, err := b.startTetherd(name, "--listeners", strconv.Itoa(b.o.balanceL))
	if err != nil {
		r.note = "skipped: tetherd --listeners could not start: " + firstLine(err.Error())
		logf("!!! %s", r.note)
		b.failed = true
		return r
	}
	defer in.stop()
	script, err := writeWrkScript(b.m.tmp, "wrk-balance", b.idsFor(t), false)
	if err != nil {
		r.note = err.Error()
		return r
	}
	type wres struct {
		res wrkResult
		err error
	}
	ch := make(chan wres, 1)
	url := fmt.Sprintf("http://127.0.0.1:%d", in.port)
	go func() {
		res, err := runWrk(b.ctx, b.wrkBin, url, script, b.o.threads, b.o.conns, b.o.dur)
		ch <- wres{res, err}
	}()
	select {
	case <-time.After(b.o.dur / 2):
	case <-b.ctx.Done():
	}
	ctlOut, ctlErr := b.tetherctlStatus(in)
	w := <-ch
	if w.err == nil {
		r.rps = w.res.rps
	}
	if ctlErr != nil {
		r.note = "tetherctl status --json failed: " + firstLine(ctlErr.Error())
		logf("!!! %s", r.note)
		return r
	}
	r.actives, r.accepted, r.states, err = parseListeners(ctlOut)
	if err != nil {
		r.note = "could not parse tetherctl status --json: " + firstLine(err.Error())
		logf("!!! %s", r.note)
		return r
	}
	r.ran = true
	return r
}

func (b *bench) tetherctlStatus(in *instance) ([]byte, error) {
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	args := []string{"status", "--json"}
	if in.pinDir != "" {
		args = append(args, "--pin-dir", in.pinDir)
	}
	args = append(args, b.o.ctlArgs...)
	cmd := exec.CommandContext(ctx, b.ctlBin, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%v: %s", err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

func (b *bench) targetByName(n string) *target {
	for _, t := range b.targets {
		if t.name == n {
			return t
		}
	}
	return nil
}

func (b *bench) main() int {
	logf("tether-bench: repo %s, %d cores, %s; wrk -t%d -c%d -d%v × %d runs", b.o.repo, runtime.NumCPU(), runtime.Version(), b.o.threads, b.o.conns, b.o.dur, b.o.runs)
	b.loadStart = loadAvg()
	if err := b.setup(); err != nil {
		logf("error: %v", err)
		return 1
	}
	if b.o.phases["rps"] {
		b.phaseRPS(false)
	}
	if b.o.phases["newconn"] && b.ctx.Err() == nil {
		b.phaseRPS(true)
	}
	if b.o.phases["bodies"] && b.ctx.Err() == nil {
		b.phaseBodies()
	}
	var bal balanceResult
	if b.o.phases["balance"] && b.ctx.Err() == nil {
		bal = b.phaseBalance()
	} else {
		bal.note = "phase not run"
	}
	var restarts []restartRow
	if b.o.phases["restart"] && b.ctx.Err() == nil {
		restarts = b.phaseRestart()
	}
	var lat latencyResult
	if b.o.phases["latency"] && b.ctx.Err() == nil {
		lat = b.phaseLatency()
	}
	var scaling []scalingRow
	if b.o.phases["scaling"] && b.ctx.Err() == nil {
		scaling = b.phaseScaling()
	}
	var pdRows []pdRow
	if b.o.phases["pd"] && b.ctx.Err() == nil {
		pdRows = b.phasePD()
	}
	var soaks []soakRow
	if b.o.phases["soak"] && b.ctx.Err() == nil {
		b.soaking = true
		soaks = b.phaseSoak()
	}
	report := b.report(bal)
	if b.o.phases["restart"] {
		report += restartReport(restarts)
	}
	report += latencyReport(lat)
	report += scalingReport(scaling)
	report += pdReport(pdRows, b.pdConns(), b.o.threads, b.o.dur)
	report += soakReport(soaks)
	fmt.Println(report)
	if b.o.out != "-" {
		if err := os.MkdirAll(filepath.Dir(b.o.out), 0o755); err == nil {
			if err := os.WriteFile(b.o.out, []byte(report), 0o644); err != nil {
				logf("error writing %s: %v", b.o.out, err)
			} else {
				logf("wrote %s", b.o.out)
			}
		}
	}
	if b.failed {
		logf("harness failure: a target could not be built or started (see above)")
		return 1
	}
	return 0
}

// helpFlags returns the flag names a Go program lists in its -h output.
func helpFlags(ctx context.Context, bin string) map[string]bool {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	out, _ := exec.CommandContext(ctx, bin, "-h").CombinedOutput()
	m := map[string]bool{}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) > 0 && strings.HasPrefix(line, "  -") {
			m[strings.TrimLeft(f[0], "-")] = true
		}
	}
	return m
}

// bpffsMounted reports whether /sys/fs/bpf is a bpf filesystem mount.
func bpffsMounted() bool {
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 3 && f[1] == "/sys/fs/bpf" && f[2] == "bpf" {
			return true
		}
	}
	return false
}

// setupPinDir chooses where the bench's tetherd pins its BPF maps (and
// where tetherctl reads them), so that the bench never shares maps with
// another tetherd on the machine and leaves nothing behind:
//   - as root: a private bpffs mounted in the temp dir, unmounted at exit;
//   - else, if /sys/fs/bpf is a bpffs: /sys/fs/bpf/tether-bench-<pid>, removed at exit;
//   - else: none (tetherd's auto mode falls back to the kernel hash).
//
// Without tetherd's --bpf-pin-dir flag the default directory is used.
func setupPinDir(m *manager, mount, hasFlag bool) (dir, note string) {
	if !hasFlag {
		if bpffsMounted() {
			return "", "tetherd has no --bpf-pin-dir: it uses its default pin dir under /sys/fs/bpf"
		}
		return "", "tetherd has no --bpf-pin-dir and /sys/fs/bpf is not a bpffs mount: tetherd cannot use BPF"
	}
	if mount && os.Geteuid() == 0 {
		mnt := filepath.Join(m.tmp, "bpffs")
		if err := os.MkdirAll(mnt, 0o700); err == nil {
			err := syscall.Mount("bpf", mnt, "bpf", 0, "")
			if err == nil {
				m.onCleanup(func() {
					if err := syscall.Unmount(mnt, 0); err != nil {
						_ = syscall.Unmount(mnt, syscall.MNT_DETACH)
					}
				})
				return mnt, "private bpffs mounted at " + mnt + " for tetherd's pinned maps (unmounted at exit)"
			}
			logf("bpffs: mount -t bpf on %s failed: %v", mnt, err)
		}
	}
	if bpffsMounted() {
		dir := fmt.Sprintf("/sys/fs/bpf/tether-bench-%d", os.Getpid())
		m.onCleanup(func() { _ = os.RemoveAll(dir) })
		return dir, "tetherd pins its maps under " + dir + " (removed at exit)"
	}
	return "", "no bpffs available (not root, /sys/fs/bpf not mounted): tetherd cannot use BPF"
}

// bpfPinned says whether the running tetherd pinned its BPF maps, i.e.
// whether the default run really steered with BPF.
func bpfPinned(dir string) string {
	if dir == "" {
		dir = "/sys/fs/bpf/tether/v1"
	}
	ents, err := os.ReadDir(dir)
	if err != nil || len(ents) == 0 {
		return "default tetherd ran WITHOUT BPF steering (no maps pinned in " + dir + ")"
	}
	return fmt.Sprintf("default tetherd ran with BPF steering (%d objects pinned in %s)", len(ents), dir)
}
