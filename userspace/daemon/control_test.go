package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/demo"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/supervisor"
	"github.com/tether-rl/tether/userspace/worker"
)

// ctlDaemon runs tetherd in-process with its admin API on a loopback port.
func ctlDaemon(t *testing.T, opts Options) *Daemon {
	t.Helper()
	opts.Listen = "127.0.0.1:0"
	opts.BPF = "off"
	if opts.Admin == "" {
		opts.Admin = "127.0.0.1:0"
	}
	if opts.Log == nil {
		opts.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if opts.Health.Interval == 0 {
		opts.Health.Interval = 50 * time.Millisecond
	}
	if opts.Registry.RemoveGrace == 0 {
		opts.Registry.RemoveGrace = 2 * time.Second
	}
	if opts.Registry.StartupTimeout == 0 {
		opts.Registry.StartupTimeout = 3 * time.Second
	}
	return serveDaemon(t, opts)
}

type ctlReply struct {
	status int
	header http.Header
	body   []byte
}

var ctlClient = &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{Proxy: nil, DisableKeepAlives: true}}

func ctlDo(t *testing.T, method, u, body string, hdr ...string) ctlReply {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, u, rd)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := ctlClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, u, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return ctlReply{resp.StatusCode, resp.Header, b}
}

func (r ctlReply) json(t *testing.T, v any) {
	t.Helper()
	if err := json.Unmarshal(r.body, v); err != nil {
		t.Fatalf("%v: %q", err, r.body)
	}
}

func startDemo(t *testing.T, index int) *demo.Server {
	t.Helper()
	s, err := demo.Start("127.0.0.1:0", demo.Options{Index: index})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// newSession creates sessions until one lands on worker want.
func newSession(t *testing.T, d *Daemon, want int) string {
	t.Helper()
	for i := 0; i < 200; i++ {
		r := ctlDo(t, "POST", "http://"+d.Addr()+"/sessions", "")
		var s struct {
			SessionID string `json:"session_id"`
			Worker    int    `json:"worker"`
		}
		r.json(t, &s)
		if s.Worker == want {
			return s.SessionID
		}
	}
	t.Fatalf("no session on worker %d", want)
	return ""
}

func chat(t *testing.T, d *Daemon, sid string) ctlReply {
	return ctlDo(t, "POST", "http://"+d.Addr()+"/sessions/"+sid+"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`)
}

// TestAdminAbsentFromDataPort: by default the admin paths on the data port
// are proxied to a worker like any other path; the registry is untouched.
func TestAdminAbsentFromDataPort(t *testing.T) {
	demos := demoWorkers(t, 0, 2)
	d := ctlDaemon(t, Options{StartedWorkers: urlsOf(demos)})
	extra := startDemo(t, 2)
	data := "http://" + d.Addr()
	for _, c := range []struct{ method, path string }{
		{"POST", "/add_worker?url=" + url.QueryEscape(extra.URL())},
		{"POST", "/remove_worker?url=" + url.QueryEscape(demos[0].URL())},
		{"GET", "/list_workers"},
		{"POST", "/workers"},
		{"GET", "/workers"},
		{"DELETE", "/workers/0"},
		{"POST", "/workers/1/drain"},
		{"GET", "/metrics"},
	} { // (/get_loads and /v1/loads are the engine fan-out on the data port)
		r := ctlDo(t, c.method, data+c.path, `{"url":"`+extra.URL()+`"}`)
		if r.header.Get("X-Tether-Demo-Worker") == "" {
			t.Errorf("%s %s on the data port answered by tetherd (%d %q), not proxied", c.method, c.path, r.status, r.body)
		}
	}
	if got := d.Registry.URLs(); len(got) != 2 {
		t.Fatalf("registry changed through the data port: %v", got)
	}
	for i := 0; i < 2; i++ {
		if w := d.Table.Get(i); w == nil || w.State() != worker.Healthy {
			t.Fatalf("worker %d changed", i)
		}
	}
}

// TestAdminOnDataPort: with --admin-on-data-port the admin API answers on
// the data port too, behind the token when one is set.
func TestAdminOnDataPort(t *testing.T) {
	d := ctlDaemon(t, Options{StartedWorkers: demoURLs(t, 0, 1), AdminOnDataPort: true, AdminToken: "tok"})
	extra := startDemo(t, 1)
	for _, base := range []string{"http://" + d.Addr(), "http://" + d.AdminAddr()} {
		if r := ctlDo(t, "GET", base+"/list_workers", ""); r.status != 401 || r.header.Get("X-Tether-Demo-Worker") != "" {
			t.Fatalf("%s without token: %d %q", base, r.status, r.body)
		}
		if r := ctlDo(t, "GET", base+"/list_workers", "", "Authorization", "Bearer nope"); r.status != 401 {
			t.Fatalf("%s wrong token: %d", base, r.status)
		}
	}
	data := "http://" + d.Addr()
	r := ctlDo(t, "POST", data+"/add_worker?url="+url.QueryEscape(extra.URL()), "", "Authorization", "Bearer tok")
	if r.status != 200 {
		t.Fatalf("add on the data port: %d %q", r.status, r.body)
	}
	var l struct{ URLs []string }
	ctlDo(t, "GET", data+"/list_workers", "", "Authorization", "Bearer tok").json(t, &l)
	if len(l.URLs) != 2 || l.URLs[1] != extra.URL() {
		t.Fatalf("list: %v", l.URLs)
	}
	// The new worker routes its sessions.
	sid := newSession(t, d, 1)
	if r := chat(t, d, sid); r.status != 200 || r.header.Get("X-Tether-Demo-Worker") != "1" {
		t.Fatalf("chat on the added worker: %d %q", r.status, r.body)
	}
	// Other paths are still proxied, tetherd's /health still local.
	if r := ctlDo(t, "GET", data+"/sessions/"+sid, ""); r.header.Get("X-Tether-Demo-Worker") != "1" {
		t.Fatalf("GET session: %d", r.status)
	}
	var h struct{ Workers, HealthyWorkers int }
	if r := ctlDo(t, "GET", data+"/health", ""); r.status != 200 {
		t.Fatalf("health: %d", r.status)
	} else {
		r.json(t, &h)
	}
	if h.Workers != 2 {
		t.Fatalf("health: %+v", h)
	}
}

// TestSlotsDrainRemove drives the registry end to end: drain keeps a
// worker's sessions and takes no new ones; remove empties its slot (its
// sessions then follow --bad-session) and leaves the others in place; a
// new worker takes the first free slot and its sessions route there.
func TestSlotsDrainRemove(t *testing.T) {
	d := ctlDaemon(t, Options{StartedWorkers: demoURLs(t, 0, 3), BadSession: route.BadSessionReject})
	admin := "http://" + d.AdminAddr()
	s1 := newSession(t, d, 1)
	s2 := newSession(t, d, 2)

	// Drain 1.
	r := ctlDo(t, "POST", admin+"/workers/1/drain", "")
	if r.status != 200 {
		t.Fatalf("drain: %d %q", r.status, r.body)
	}
	for i := 0; i < 30; i++ {
		var s struct{ Worker int }
		ctlDo(t, "POST", "http://"+d.Addr()+"/sessions", "").json(t, &s)
		if s.Worker == 1 {
			t.Fatal("new session on a draining worker")
		}
	}
	for i := 0; i < 3; i++ {
		if r := chat(t, d, s1); r.status != 200 || r.header.Get("X-Tether-Demo-Worker") != "1" {
			t.Fatalf("existing session on the draining worker: %d %q", r.status, r.body)
		}
	}
	var l struct {
		Workers []registry.Info
	}
	ctlDo(t, "GET", admin+"/workers", "").json(t, &l)
	if len(l.Workers) != 3 || l.Workers[1].State != "draining" || l.Workers[1].Requests == 0 {
		t.Fatalf("workers: %+v", l.Workers)
	}

	// Remove 1: its sessions are rejected (--bad-session reject), 2 stays.
	if r := ctlDo(t, "DELETE", admin+"/workers/1", ""); r.status != 200 {
		t.Fatalf("remove: %d %q", r.status, r.body)
	}
	if r := chat(t, d, s1); r.status != 404 || r.header.Get("X-Tether-Demo-Worker") != "" {
		t.Fatalf("session of a removed worker: %d %q", r.status, r.body)
	}
	if r := chat(t, d, s2); r.status != 200 || r.header.Get("X-Tether-Demo-Worker") != "2" {
		t.Fatalf("session on slot 2 after removing slot 1: %d", r.status)
	}
	if d.Table.Get(1) != nil || d.Table.Get(2) == nil || d.Table.Get(0) == nil {
		t.Fatal("slots moved")
	}
	if err := d.Registry.WaitRetired(t.Context(), 1); err != nil {
		t.Fatal(err)
	}
	// A new worker takes slot 1.
	nw := startDemo(t, 1)
	var a struct {
		Slot   int
		Status string
	}
	r = ctlDo(t, "POST", admin+"/workers", `{"url":"`+nw.URL()+`"}`)
	if r.status != 200 {
		t.Fatalf("add: %d %q", r.status, r.body)
	}
	r.json(t, &a)
	if a.Slot != 1 || a.Status != "healthy" {
		t.Fatalf("add: %+v", a)
	}
	sid := newSession(t, d, 1)
	if r := chat(t, d, sid); r.status != 200 || r.header.Get("X-Tether-Demo-Worker") != "1" {
		t.Fatalf("session on the new worker: %d", r.status)
	}
	// Its counters started from zero.
	var in registry.Info
	ctlDo(t, "GET", admin+"/workers/1", "").json(t, &in)
	if in.URL != nw.URL() || in.Requests > 40 {
		t.Fatalf("new worker: %+v", in)
	}
}

func metricValue(t *testing.T, body, series string) float64 {
	t.Helper()
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` (\S+)$`)
	m := re.FindStringSubmatch(body)
	if m == nil {
		return -1
	}
	v, _ := strconv.ParseFloat(m[1], 64)
	return v
}

// TestMetricsMove: the per-worker, per-listener and per-request series are
// there and move with traffic.
func TestMetricsMove(t *testing.T) {
	demos := demoWorkers(t, 0, 2)
	d := ctlDaemon(t, Options{StartedWorkers: urlsOf(demos)})
	admin := "http://" + d.AdminAddr()
	u0 := demos[0].URL()
	lbl := `{slot="0",url="` + u0 + `"}`
	before := string(ctlDo(t, "GET", admin+"/metrics", "").body)
	for _, s := range []string{"tether_worker_requests_total" + lbl, "tether_worker_in_flight" + lbl,
		`tether_worker_healthy` + lbl, `tether_listener_connections_accepted_total{listener="0"}`,
		`tether_route_decisions_total{reason="session"}`, `tether_panic`,
		`tether_responses_total{code_class="2xx",slot="0",url="` + u0 + `"}`,
		`tether_request_duration_seconds_count` + lbl} {
		if metricValue(t, before, s) < 0 {
			t.Errorf("missing %s", s)
		}
	}
	sid := newSession(t, d, 0)
	for i := 0; i < 5; i++ {
		chat(t, d, sid)
	}
	after := string(ctlDo(t, "GET", admin+"/metrics", "").body)
	for _, s := range []string{"tether_worker_requests_total" + lbl, `tether_listener_connections_accepted_total{listener="0"}`,
		`tether_route_decisions_total{reason="session"}`, `tether_responses_total{code_class="2xx",slot="0",url="` + u0 + `"}`,
		`tether_request_duration_seconds_count` + lbl, `tether_worker_bytes_total{direction="down",slot="0",url="` + u0 + `"}`} {
		if b, a := metricValue(t, before, s), metricValue(t, after, s); a < b+5 {
			t.Errorf("%s: %v -> %v, want +5 at least", s, b, a)
		}
	}
	if t.Failed() {
		t.Log(after)
	}
}

// TestHealthPanicAndBack: a worker that dies is marked unhealthy and gets
// no new sessions; with every worker dead tetherd routes anyway (panic)
// and says so; a worker back on its port is healthy again.
func TestHealthPanicAndBack(t *testing.T) {
	w0 := startDemo(t, 0)
	demos := demoWorkers(t, 1, 1)
	d := ctlDaemon(t, Options{Workers: []string{w0.URL()}, StartedWorkers: urlsOf(demos), Registry: registry.Config{Failures: 2, Successes: 1}})
	admin := "http://" + d.AdminAddr()
	addr := strings.TrimPrefix(w0.URL(), "http://")
	w0.Close()
	testenv.WaitFor(t, "the dead worker unhealthy", func() bool { return d.Table.Get(0).State() == worker.Unhealthy })
	for i := 0; i < 10; i++ {
		var s struct{ Worker int }
		ctlDo(t, "POST", "http://"+d.Addr()+"/sessions", "").json(t, &s)
		if s.Worker != 1 {
			t.Fatalf("new session on worker %d", s.Worker)
		}
	}
	// Kill the other one too: panic mode.
	demos[0].Close()
	testenv.WaitFor(t, "panic mode", d.Registry.Panic)
	r := ctlDo(t, "GET", "http://"+d.Addr()+"/sessions/w0-00000000000000000000000000000000", "")
	if r.status != 502 {
		t.Fatalf("panic routing: %d (want a 502 from a dead worker, not a 503 storm)", r.status)
	}
	var h map[string]any
	ctlDo(t, "GET", admin+"/health", "").json(t, &h)
	if h["panic"] != true || h["status"] != "degraded" {
		t.Fatalf("admin health: %v", h)
	}
	// Worker 0 comes back on its port.
	back, err := demo.Start(addr, demo.Options{Index: 0})
	if err != nil {
		t.Fatal(err)
	}
	defer back.Close()
	testenv.WaitFor(t, "the worker back healthy, panic mode over", func() bool {
		return d.Table.Get(0).State() == worker.Healthy && !d.Registry.Panic()
	})
}

// TestReload: the worker list is reconciled by url (kept slots stay), the
// bad-session mode changes, and an invalid reload changes nothing.
func TestReload(t *testing.T) {
	a, b, c := startDemo(t, 0), startDemo(t, 1), startDemo(t, 2)
	d := ctlDaemon(t, Options{Workers: []string{a.URL(), b.URL()}})
	admin := startDemo(t, 9)
	if _, err := d.Registry.Add(t.Context(), admin.URL(), registry.OriginAdmin); err != nil {
		t.Fatal(err)
	}
	before, policy := fmt.Sprint(d.Registry.URLs()), d.Router.CurrentPolicy()
	for _, bad := range []Options{
		{Workers: []string{b.URL(), "https://127.0.0.1:1"}},
		// Valid workers and bad-session, invalid routing: nothing applies
		// (every check runs before any worker changes).
		{Workers: []string{b.URL()}, BadSession: route.BadSessionReject, Routing: RoutingOptions{StickyStore: "bogus"}},
		{Workers: []string{b.URL()}, BadSession: route.BadSessionReject, Routing: RoutingOptions{Keys: route.PolicySettings{LoadFactor: 0.5}}},
		{Workers: []string{b.URL()}, BadSession: route.BadSessionReject, Routing: RoutingOptions{PeekBytes: -2}},
	} {
		if err := d.Reload(bad); err == nil {
			t.Fatalf("invalid reload accepted: %+v", bad)
		}
	}
	if fmt.Sprint(d.Registry.URLs()) != before || d.Router.BadSessionMode() != route.BadSessionSpread || d.Router.CurrentPolicy() != policy {
		t.Fatalf("an invalid reload changed something: workers %v (were %s), bad-session %v", d.Registry.URLs(), before, d.Router.BadSessionMode())
	}
	if err := d.Reload(Options{Workers: []string{b.URL(), c.URL()}, BadSession: route.BadSessionReject}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		urls := map[string]bool{}
		for _, u := range d.Registry.URLs() {
			urls[u] = true
		}
		if urls[c.URL()] && !urls[a.URL()] {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("reload not applied: %v", d.Registry.URLs())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if w := d.Table.Get(1); w == nil || w.URL != b.URL() {
		t.Fatal("kept worker moved")
	}
	if w := d.Table.Get(2); w == nil || w.URL != admin.URL() {
		t.Fatal("admin-added worker touched by the reload")
	}
	if d.Router.BadSessionMode() != route.BadSessionReject {
		t.Fatal("bad-session not reloaded")
	}
	// A slot no worker holds (the removed slot 0 may already hold c, once
	// a's retirement ended before c's first good check).
	if r := chat(t, d, "w7-00000000000000000000000000000000"); r.status != 404 {
		t.Fatalf("session of an empty slot with reject: %d", r.status)
	}
}

func TestNoWorkers(t *testing.T) {
	if _, err := New(Options{Listen: "127.0.0.1:0", BPF: "off"}); err == nil {
		t.Fatal("no workers and no admin API accepted")
	}
	// With an admin API tetherd starts empty and workers come later.
	d := ctlDaemon(t, Options{})
	w := startDemo(t, 0)
	if r := ctlDo(t, "GET", "http://"+d.Addr()+"/sessions/w0-00000000000000000000000000000000", ""); r.status != 503 {
		t.Fatalf("no workers: %d", r.status)
	}
	if r := ctlDo(t, "POST", "http://"+d.AdminAddr()+"/add_worker?url="+url.QueryEscape(w.URL()), ""); r.status != 200 {
		t.Fatalf("add: %d %q", r.status, r.body)
	}
	if r := chat(t, d, "w0-00000000000000000000000000000000"); r.status != 200 {
		t.Fatalf("after add: %d", r.status)
	}
}

// buildDemo builds cmd/tether-demo once per test binary.
func buildDemo(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "tether-demo")
	cmd := exec.Command("go", "build", "-o", bin, "github.com/tether-rl/tether/cmd/tether-demo")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Skipf("cannot build tether-demo: %v\n%s", err, out)
	}
	return bin
}

// TestSpawn: tetherd --spawn 2 -- tether-demo --listen 127.0.0.1:{port}
// --index {index}: both come up in slots 0 and 1, sessions route to them,
// a crashed one comes back in its slot, and Shutdown leaves no process.
func TestSpawn(t *testing.T) {
	if testing.Short() {
		t.Skip("builds tether-demo")
	}
	bin := buildDemo(t)
	opts := Options{Spawn: supervisor.Config{N: 2, Command: []string{bin, "--listen", "127.0.0.1:{port}", "--index", "{index}"}, Grace: 5 * time.Second},
		SpawnOutput: io.Discard, Registry: registry.Config{StartupTimeout: 20 * time.Second}}
	opts.Listen, opts.BPF, opts.Admin = "127.0.0.1:0", "off", "127.0.0.1:0"
	opts.Health.Interval = 100 * time.Millisecond
	opts.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	d, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	d.Serve()
	shut := false
	defer func() {
		if !shut {
			d.Close()
		}
	}()
	deadline := time.Now().Add(30 * time.Second)
	for d.Table.Get(0) == nil || d.Table.Get(1) == nil {
		if time.Now().After(deadline) {
			t.Fatalf("spawned workers not up: %+v", d.Registry.List())
		}
		time.Sleep(20 * time.Millisecond)
	}
	s0, s1 := newSession(t, d, 0), newSession(t, d, 1)
	if r := chat(t, d, s1); r.status != 200 || r.header.Get("X-Tether-Demo-Worker") != "1" {
		t.Fatalf("chat on spawned worker 1: %d", r.status)
	}
	// Removing a spawned worker is refused; it is the supervisor's.
	if r := ctlDo(t, "DELETE", "http://"+d.AdminAddr()+"/workers/0", ""); r.status != 409 {
		t.Fatalf("remove spawned: %d", r.status)
	}
	procs := d.Supervisor.Procs()
	pids := []int{procs[0].PID, procs[1].PID}
	syscall.Kill(pids[0], syscall.SIGKILL)
	for {
		p := d.Supervisor.Procs()[0]
		if p.Ready && p.PID != pids[0] && d.Table.Get(0).State() == worker.Healthy {
			pids = append(pids, p.PID)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("crashed worker not restarted: %+v", p)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if r := chat(t, d, s0); r.status != 200 || r.header.Get("X-Tether-Demo-Worker") != "0" {
		t.Fatalf("slot 0 after restart: %d", r.status)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	d.Shutdown(ctx)
	shut = true
	for _, pid := range pids {
		if b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat"); err == nil && !strings.Contains(string(b), ") Z ") {
			t.Errorf("worker process %d alive after Shutdown: %s", pid, b)
		}
	}
}

// tetherd refuses itself as a worker (data or admin address, by any name):
// a request would loop through it until its descriptors ran out.
func TestSelfNotAWorker(t *testing.T) {
	d := ctlDaemon(t, Options{StartedWorkers: demoURLs(t, 0, 1)})
	_, port, _ := net.SplitHostPort(d.Addr())
	_, aport, _ := net.SplitHostPort(d.AdminAddr())
	for _, u := range []string{"http://" + d.Addr(), "http://localhost:" + port, "http://127.0.0.1:" + aport} {
		r := ctlDo(t, "POST", "http://"+d.AdminAddr()+"/workers", `{"url":"`+u+`"}`)
		if r.status != 400 || !strings.Contains(string(r.body), "tetherd itself") {
			t.Errorf("add %s: %d %s", u, r.status, r.body)
		}
	}
	if n := len(d.Registry.URLs()); n != 1 {
		t.Fatalf("%d workers", n)
	}
	// At start too.
	if _, err := New(Options{Listen: "127.0.0.1:18779", Workers: []string{"http://localhost:18779"}, BPF: "off", Admin: ""}); err == nil || !strings.Contains(err.Error(), "tetherd itself") {
		t.Fatalf("itself in --worker: %v", err)
	}
}

// The admin API bounds reading a whole request: a body trickled a byte at
// a time is cut off at adminReadTimeout.
func TestAdminSlowBodyCut(t *testing.T) {
	old := adminReadTimeout
	adminReadTimeout = 300 * time.Millisecond
	defer func() { adminReadTimeout = old }()
	d := ctlDaemon(t, Options{StartedWorkers: demoURLs(t, 0, 1)})
	c, err := net.Dial("tcp", d.AdminAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	io.WriteString(c, "POST /workers HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
	start := time.Now()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	for {
		if _, err := c.Write([]byte(" ")); err != nil {
			break
		}
		buf := make([]byte, 512)
		c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		if _, err := c.Read(buf); err != nil && !isTimeoutErr(err) {
			break // answered or closed
		}
		if time.Since(start) > 5*time.Second {
			t.Fatal("a trickled admin body kept the connection open for 5 s")
		}
	}
}

func isTimeoutErr(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}

// The admin API under bad input and contention: every malformed call gets
// a clear 4xx and changes nothing; 100 parallel add/remove calls over the
// legacy and REST endpoints leave one consistent table (unique slots, each
// URL once, the registry's view equal to the routing table's).
func TestAdminUnderBadInputAndContention(t *testing.T) {
	d := ctlDaemon(t, Options{StartedWorkers: demoURLs(t, 0, 1)})
	admin := "http://" + d.AdminAddr()
	before := ctlDo(t, "GET", admin+"/list_workers", "").body
	for _, tc := range []struct{ method, path, body string }{
		{"POST", "/workers", `{"url":`},
		{"POST", "/workers", `[1,2,3]`},
		{"POST", "/workers", `{"url":"ftp://x"}`},
		{"POST", "/workers", `{"url":"http://"}`},
		{"POST", "/workers", `{"url":"http://a b:1"}`},
		{"POST", "/workers", `{"url":"http://127.0.0.1:99999"}`},
		{"POST", "/workers", `{"url":"http://127.0.0.1:1","max_in_flight":-1}`},
		{"POST", "/workers", `{"url":"http://127.0.0.1:1"} trailing`},
		{"POST", "/workers", `{"url":"http://127.0.0.1:1","worker_type":"prefill"}`},
		{"POST", "/add_worker?url=", ""},
		{"POST", "/add_worker?url=%zz", ""},
		{"POST", "/remove_worker?url=http://127.0.0.1:1", ""},
		{"DELETE", "/workers/99", ""},
		{"DELETE", "/workers/not-an-id", ""},
		{"POST", "/workers/99/drain", ""},
		{"PATCH", "/workers/0", `{"max_in_flight":"many"}`},
		{"PATCH", "/workers/0", `{}`},
		{"POST", "/workers", strings.Repeat("x", 2<<20)},
	} {
		r := ctlDo(t, tc.method, admin+tc.path, tc.body)
		if r.status < 400 || r.status >= 500 {
			t.Errorf("%s %s %.40q: %d %s, want a 4xx", tc.method, tc.path, tc.body, r.status, r.body)
		}
		if len(r.body) == 0 || !strings.Contains(string(r.body), "error") && !strings.Contains(string(r.body), "message") {
			t.Errorf("%s %s %.40q: %d without a message: %q", tc.method, tc.path, tc.body, r.status, r.body)
		}
	}
	if after := ctlDo(t, "GET", admin+"/list_workers", "").body; string(after) != string(before) {
		t.Fatalf("bad input changed the table: %s → %s", before, after)
	}

	var urls []string
	for i := range 10 {
		urls = append(urls, startDemo(t, i+1).URL())
	}
	done := make(chan struct{})
	for i := range 100 {
		go func() {
			defer func() { done <- struct{}{} }()
			u := urls[i%len(urls)]
			var method, path, body string
			switch i % 4 {
			case 0:
				method, path = "POST", "/add_worker?url="+url.QueryEscape(u)
			case 1:
				method, path, body = "POST", "/workers", `{"url":"`+u+`"}`
			case 2:
				method, path = "POST", "/remove_worker?url="+url.QueryEscape(u)
			case 3:
				method, path = "DELETE", "/workers/"+url.PathEscape(u)
			}
			r := ctlDo(t, method, admin+path, body)
			if r.status >= 500 && r.status != 503 {
				t.Errorf("%s %s: %d %s", method, path, r.status, r.body)
			}
		}()
	}
	for range 100 {
		<-done
	}
	// Settled: no add pending any more, then one consistent view.
	var l struct{ Workers []registry.Info }
	testenv.WaitFor(t, "no pending adds", func() bool {
		ctlDo(t, "GET", admin+"/workers", "").json(t, &l)
		for _, w := range l.Workers {
			if w.State == registry.StatePending {
				return false
			}
		}
		return true
	})
	slots, seen := map[int]bool{}, map[string]bool{}
	for _, w := range l.Workers {
		if w.State == registry.StateRemoved {
			continue // retiring: out of the table, its slot not free yet
		}
		if slots[w.Slot] || seen[w.URL] {
			t.Fatalf("slot %d or url %s twice: %+v", w.Slot, w.URL, l.Workers)
		}
		slots[w.Slot], seen[w.URL] = true, true
		rw := d.Table.Get(w.Slot)
		if rw == nil || rw.URL != w.URL {
			t.Fatalf("registry has %s in slot %d (%s), the routing table %v", w.URL, w.Slot, w.State, rw)
		}
	}
	n := 0
	for _, rw := range d.Table.Snapshot() {
		if rw != nil {
			n++
			if !seen[rw.URL] {
				t.Fatalf("routing table has %s, the registry does not", rw.URL)
			}
		}
	}
	if n != len(seen) {
		t.Fatalf("routing table %d workers, registry %d", n, len(seen))
	}
	// Still serving.
	if r := ctlDo(t, "GET", "http://"+d.Addr()+"/health", ""); r.status != 200 {
		t.Fatalf("health after the storm: %d", r.status)
	}
}
