package daemon

import (
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/bpf"
	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/sticky"
)

// runRouting starts tetherd in-process on loopback for the routing tests.
func runRouting(t *testing.T, opts Options) (*Daemon, func(method, path, body string, hdr ...string) (int, http.Header, []byte)) {
	t.Helper()
	d := serveDaemon(t, opts)
	tr := &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 4}
	t.Cleanup(tr.CloseIdleConnections)
	c := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	do := func(method, path, body string, hdr ...string) (int, http.Header, []byte) {
		t.Helper()
		req, err := http.NewRequest(method, "http://"+d.Addr()+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header, b
	}
	return d, do
}

const chatBody = `{"messages":[{"role":"user","content":"hi"}]}`

func TestRoutingPolicyEndToEnd(t *testing.T) {
	d, do := runRouting(t, Options{StartedWorkers: demoURLs(t, 0, 4), BPF: "off"})
	if k := d.Router.CurrentPolicy().Config().Kind; k != route.PolicyHash {
		t.Fatalf("default policy %v", k)
	}
	worker := func(hdr ...string) string {
		st, h, b := do("POST", "/v1/chat/completions", chatBody, hdr...)
		if st != 200 {
			t.Fatalf("chat %v: %d %s", hdr, st, b)
		}
		return h.Get("X-Tether-Demo-Worker")
	}
	// Every turn of a key on one engine; keys spread.
	used := map[string]bool{}
	for k := 0; k < 40; k++ {
		key := "sampling-" + strconv.Itoa(k) + ":0"
		w := worker("X-Session-ID", key)
		used[w] = true
		for turn := 0; turn < 3; turn++ {
			hdr := "X-Session-ID"
			if turn == 1 {
				hdr = "X-SMG-Routing-Key" // same key, other header: same engine
			}
			if got := worker(hdr, key); got != w {
				t.Fatalf("key %s turn %d on %s, first on %s", key, turn, got, w)
			}
		}
	}
	if len(used) < 3 {
		t.Errorf("40 keys on %d workers", len(used))
	}
	if got := worker("X-SMG-Target-Worker", "2"); got != "2" {
		t.Errorf("target 2: worker %s", got)
	}
	if st, _, b := do("POST", "/v1/chat/completions", chatBody, "X-SMG-Target-Worker", "9"); st != 400 || !strings.Contains(string(b), "X-SMG-Target-Worker names no worker") {
		t.Errorf("target 9: %d %s", st, b)
	}
	// Engine fan-out on the data port.
	st, _, b := do("GET", "/get_loads", "")
	var loads struct{ Successful, Failed []json.RawMessage }
	if json.Unmarshal(b, &loads); st != 200 || len(loads.Successful) != 4 {
		t.Fatalf("get_loads: %d %s", st, b)
	}
	if st, _, b := do("POST", "/abort_request", `{"rid":5}`); st != 400 {
		t.Errorf("bad abort: %d %s", st, b)
	}

	// SIGHUP: switch to sticky (kept in process with --bpf=off).
	opts := d.opts
	opts.Routing.Policy = route.PolicySticky
	opts.Routing.Keys.StickyTTL = time.Minute
	if err := d.Reload(opts); err != nil {
		t.Fatal(err)
	}
	cfg := d.Router.CurrentPolicy().Config()
	if cfg.Kind != route.PolicySticky || cfg.Sticky.Shared() || cfg.StickyTTL != time.Minute {
		t.Fatalf("after reload: %+v", cfg)
	}
	first := worker("X-Session-ID", "traj")
	if got := worker("X-Session-ID", "traj"); got != first {
		t.Fatalf("sticky: %s then %s", first, got)
	}
	if st, _, b := do("POST", "/finish_session?session_id=traj", ""); st != 200 || !strings.Contains(string(b), `"finished":true`) {
		t.Fatalf("finish_session: %d %s", st, b)
	}
	// An invalid reload changes nothing.
	bad := opts
	bad.Routing.Policy, bad.Routing.Keys.LoadFactor = route.PolicyHash, 0.5
	if err := d.Reload(bad); err == nil {
		t.Error("invalid load factor accepted")
	}
	if d.Router.CurrentPolicy().Config().Kind != route.PolicySticky {
		t.Error("invalid reload changed the policy")
	}
	// Learned sessions and spill settings reload too; a bad learn path
	// changes nothing.
	if l := d.Router.CurrentLearning(); l == nil || l.Config().CreatePath != "/sessions" {
		t.Fatalf("learning on by default: %+v", l)
	}
	bad = opts
	bad.Routing.Learn.CreatePath = "sessions"
	if err := d.Reload(bad); err == nil || d.Router.CurrentLearning().Config().CreatePath != "/sessions" {
		t.Errorf("bad learn path: %v", err)
	}
	opts.Routing.LearnSessions = config.Some(false)
	opts.Routing.Keys.SpillMin = config.Some(5)
	if err := d.Reload(opts); err != nil {
		t.Fatal(err)
	}
	if d.Router.CurrentLearning() != nil || d.Router.CurrentPolicy().Config().SpillMin != config.Some(5) {
		t.Error("reload did not turn learning off or set the spill bound")
	}
	// Invalid options refuse to start.
	for _, ro := range []RoutingOptions{{StickyStore: "x"}, {PeekBytes: -2}, {MaxTrackedRequests: -1}, {Keys: route.PolicySettings{LoadFactor: 0.5}}, {Keyless: route.KeylessPrefix, PeekBytes: -1}, {PeekBytes: 1 << 20},
		{Keys: route.PolicySettings{KeyHeaders: []string{"a b"}}}, {Keys: route.PolicySettings{SpillTTL: time.Millisecond}},
		{Learn: route.LearnSettings{CreatePath: "/sessions?x"}}, {Learn: route.LearnSettings{TTL: time.Millisecond}}} {
		o := Options{Listen: "127.0.0.1:0", StartedWorkers: demoURLs(t, 0, 1), BPF: "off", Routing: ro, Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
		if d, err := New(o); err == nil {
			d.Close()
			t.Errorf("%+v accepted", ro)
		}
	}
}

// With BPF steering loaded, --policy=sticky keeps its table in the group's
// sticky_sessions map: a second tetherd on the same pins sees it.
func TestStickyTableInSteeringMap(t *testing.T) {
	testenv.RequireBPF(t)
	pins := testenv.BPFFS(t)
	opts := Options{StartedWorkers: demoURLs(t, 0, 2), BPF: "required", PinDir: pins, Routing: RoutingOptions{Policy: route.PolicySticky}}
	d1, do1 := runRouting(t, opts)
	// A second tetherd on the same pins: the first owns the steering maps
	// (its listener group), so this one runs on the kernel hash, and
	// shares the sticky table.
	if _, err := New(Options{Listen: "127.0.0.1:0", StartedWorkers: demoURLs(t, 0, 1), BPF: "required", PinDir: pins}); !errors.Is(err, bpf.ErrPinDirBusy) {
		t.Fatalf("second tetherd with --bpf=required on the same pins: %v, want ErrPinDirBusy", err)
	}
	// It routes to the same engines (entries name their worker: another
	// engine in the same slot would not inherit the key).
	opts.BPF = "auto"
	opts.StartedWorkers = nil
	opts.Workers = d1.Registry.URLs()
	d2, do2 := runRouting(t, opts)
	if d1.Group.Steering() == nil || d2.Group.Steering() != nil {
		t.Fatal("steering: the first tetherd should have it, the second not")
	}
	if !d1.Router.CurrentPolicy().Config().Sticky.Shared() {
		t.Fatal("sticky table not in BPF")
	}
	st, h, b := do1("POST", "/v1/chat/completions", chatBody, "X-Session-ID", "shared-traj")
	if st != 200 {
		t.Fatalf("%d %s", st, b)
	}
	slot, _ := strconv.Atoi(h.Get("X-Tether-Demo-Worker"))
	bt, err := sticky.NewBPF(d1.Group.Steering().StickyMap())
	if err != nil {
		t.Fatal(err)
	}
	e, ok := bt.Lookup(route.KeyHashString("shared-traj"))
	if !ok || int(e.Worker) != slot || !e.Live(sticky.Now()) {
		t.Fatalf("map entry %+v %v, routed to %d", e, ok, slot)
	}
	// The other process follows the entry.
	if _, h, _ := do2("POST", "/v1/chat/completions", chatBody, "X-Session-ID", "shared-traj"); h.Get("X-Tether-Demo-Worker") != strconv.Itoa(slot) {
		t.Fatalf("second tetherd routed to %s, entry says %d", h.Get("X-Tether-Demo-Worker"), slot)
	}
	if d2.Router.Count(route.ReasonSticky) != 1 {
		t.Error("second tetherd did not use the shared entry")
	}
	// finish_session in one process, seen by the other.
	if st, _, b := do2("POST", "/finish_session?session_id=shared-traj", ""); st != 200 || !strings.Contains(string(b), `"finished":true`) {
		t.Fatalf("finish: %d %s", st, b)
	}
	if _, ok := bt.Lookup(route.KeyHashString("shared-traj")); ok {
		t.Error("entry still in the map")
	}
}
