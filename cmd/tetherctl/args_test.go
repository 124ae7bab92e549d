package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/etcdtest"
)

const testTimeout = 5 * time.Second

// An address is taken in the form tetherd's own flags take it (HOST:PORT,
// :PORT) or as a URL, everywhere.
func TestAdminAddressForms(t *testing.T) {
	for in, want := range map[string]string{
		"127.0.0.1:8081":         "http://127.0.0.1:8081",
		"http://127.0.0.1:8081":  "http://127.0.0.1:8081",
		"http://127.0.0.1:8081/": "http://127.0.0.1:8081",
		"https://admin.local:1":  "https://admin.local:1",
		"localhost:8081":         "http://localhost:8081",
		":8081":                  "http://127.0.0.1:8081",
		"8081":                   "http://127.0.0.1:8081",
		"[::1]:8081":             "http://[::1]:8081",
		" 10.0.0.1:8081 ":        "http://10.0.0.1:8081",
	} {
		if got, err := adminURL(in); err != nil || got != want {
			t.Errorf("adminURL(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"", "ftp://x:1", "http://", "http://x:1?a=b", "http://u:p@x:1"} {
		if got, err := adminURL(in); err == nil {
			t.Errorf("adminURL(%q) = %q, want an error", in, got)
		}
	}
	for in, want := range map[string]string{
		"etcd://10.0.0.1:2379,10.0.0.2:2379": "etcd://10.0.0.1:2379,10.0.0.2:2379",
		"10.0.0.1:2379":                      "etcd://10.0.0.1:2379",
		"http://10.0.0.1:2379,10.0.0.2:2379": "etcd://10.0.0.1:2379,10.0.0.2:2379",
		"http://10.0.0.1:2379/":              "etcd://10.0.0.1:2379",
	} {
		if got, err := etcdEndpoints(in); err != nil || got != want {
			t.Errorf("etcdEndpoints(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"", "https://x:1", "etcd://", "a:1,,b:2"} {
		if got, err := etcdEndpoints(in); err == nil {
			t.Errorf("etcdEndpoints(%q) = %q, want an error", in, got)
		}
	}

	// Both forms against a live admin API, for workers and status.
	base := adminServer(t, "")
	hostPort := strings.TrimPrefix(base, "http://")
	for _, addr := range []string{hostPort, base, base + "/"} {
		if code, out, errs := ctl("workers", "list", "--admin", addr); code != 0 || !strings.Contains(out, "0 workers") {
			t.Errorf("workers list --admin %s: %d %q %q", addr, code, out, errs)
		}
		ac, err := newAdminClient(addr, "", testTimeout)
		if err != nil {
			t.Fatal(err)
		}
		st := &Status{Workers: []WorkerStatus{}}
		if err := st.readCurrent(ac); err != nil || !st.CurrentKnown {
			t.Errorf("status --admin %s: %v", addr, err)
		}
	}
	// A bad address is a usage error (exit 2), not a failure inside.
	if code, _, errs := ctl("status", "--admin", "ftp://x:1", "--pin-dir", t.TempDir()); code != 2 || !strings.Contains(errs, "want HOST:PORT") {
		t.Errorf("status --admin ftp://x:1: %d %q", code, errs)
	}
}

// The ROUTING section through the host:port form: before, "parse ...:
// first path segment in URL cannot contain colon".
func TestStatusRoutingHostPort(t *testing.T) {
	testenv.RequireBPF(t)
	_, _, pin := tetherd(t, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/routing":
			w.Write([]byte(`{"policy":"hash","decisions":{"hash":4}}`))
		case "/workers":
			w.Write([]byte(`{"workers":[]}`))
		default:
			w.WriteHeader(404)
		}
	}))
	defer srv.Close()
	code, out, errs := ctl("status", "--pin-dir", pin, "--admin", strings.TrimPrefix(srv.URL, "http://"))
	if code != 0 || !strings.Contains(out, "ROUTING (policy hash)") || strings.Contains(out, "not available") {
		t.Fatalf("status --admin HOST:PORT: %d\n%s\n%s", code, out, errs)
	}
}

// Flags go before or after the verb and its subcommand, for every verb.
func TestFlagsAnywhere(t *testing.T) {
	base := adminServer(t, "")
	a := []string{"--admin", base}
	cat := func(parts ...[]string) []string {
		var out []string
		for _, p := range parts {
			out = append(out, p...)
		}
		return out
	}
	w := func(s ...string) []string { return s }
	// Each placement of the flags: after the subcommand, between the verb
	// and the subcommand, before the verb.
	placements := []func(verb, sub, args []string) []string{
		func(v, s, x []string) []string { return cat(v, s, x, a) },
		func(v, s, x []string) []string { return cat(v, a, s, x) },
		func(v, s, x []string) []string { return cat(a, v, s, x) },
		func(v, s, x []string) []string { return cat(v, s, a, x) },
	}
	for i, place := range placements {
		u := "http://127.0.0.1:" + []string{"9101", "9102", "9103", "9104"}[i]
		steps := []struct {
			args []string
			want string
		}{
			{place(w("workers"), w("add"), w(u)), "added: slot "},
			{place(w("workers"), w("list"), nil), u},
			{place(w("workers"), w("drain"), w(u)), "draining: slot "},
			{place(w("workers"), w("undrain"), w(u)), "undrained: slot "},
			{place(w("workers"), w("list"), w("--json")), `"url":"` + u + `"`},
			{place(w("workers"), w("remove"), w(u)), "removed: slot "},
		}
		for _, s := range steps {
			if code, out, errs := ctl(s.args...); code != 0 || !strings.Contains(out, s.want) {
				t.Errorf("%q: %d %q %q, want %q", s.args, code, out, errs, s.want)
			}
		}
	}
	// --json before the subcommand: a flag without a value.
	if code, out, errs := ctl("workers", "--json", "--admin", base, "list"); code != 0 || !strings.HasPrefix(out, `{"workers":`) {
		t.Errorf("workers --json --admin X list: %d %q %q", code, out, errs)
	}
	// A flag's value that is also a verb's or subcommand's name is a value.
	if code, _, errs := ctl("--token", "list", "workers", "--admin", base, "list"); code != 0 {
		t.Errorf("--token list workers ... list: %d %q", code, errs)
	}
	// The other verbs: flags before the verb or the subcommand reach them
	// (each fails on what its flags name, not on usage).
	none := filepath.Join(t.TempDir(), "none")
	for _, args := range [][]string{
		{"--pin-dir", none, "status", "--admin", "off"},
		{"status", "--pin-dir", none, "--admin=off"},
		{"listeners", "--pin-dir", none, "drain", "1"},
		{"--pin-dir", none, "listeners", "drain", "1"},
	} {
		if code, _, errs := ctl(args...); code != 1 || !strings.Contains(errs, "tetherd is not running with BPF (no maps pinned at "+none) {
			t.Errorf("%q: %d %q", args, code, errs)
		}
	}
	for _, args := range [][]string{
		{"--pidfile", none, "upgrade"},
		{"upgrade", "--timeout", "1s", "--pidfile", none},
	} {
		if code, _, errs := ctl(args...); code != 1 || !strings.Contains(errs, "pidfile: ") || !strings.Contains(errs, none) {
			t.Errorf("%q: %d %q", args, code, errs)
		}
	}
	// workers register: its flags before the subcommand too (refused here
	// for what they say, after parsing).
	if code, _, errs := ctl("workers", "--cluster", "127.0.0.1:2379", "--lease", "5s", "register"); code != 2 || !strings.Contains(errs, "wants one argument") {
		t.Errorf("workers --cluster X register: %d %q", code, errs)
	}
	if code, _, errs := ctl("workers", "--cluster", "https://x:1", "register", "http://127.0.0.1:9"); code != 2 || !strings.Contains(errs, "want etcd://HOST:PORT") {
		t.Errorf("workers --cluster https://x:1 register: %d %q", code, errs)
	}
	// Usage errors stay usage errors.
	for _, args := range [][]string{{"--admin", base}, {"--admin", base, "frob"}, {"workers", "--admin", base}, {"listeners", "--pin-dir", none}} {
		if code, _, errs := ctl(args...); code != 2 {
			t.Errorf("%q: exit %d, want 2 (%q)", args, code, errs)
		}
	}
}

// workers register takes etcd's address in tetherd's form and in etcd's
// own (HOST:PORT, http://HOST:PORT).
func TestWorkersRegisterAddressForms(t *testing.T) {
	etcd := etcdtest.Start(t)
	for i, ep := range []string{etcd.Endpoint(), "http://" + etcd.Endpoint()} {
		ctx, cancel := context.WithCancel(context.Background())
		out := &testenv.Buffer{}
		done := make(chan error, 1)
		u := "http://127.0.0.1:3000" + string(rune('1'+i))
		go func() { done <- register(ctx, []string{"--cluster", ep, "--lease", "2s", u}, out) }()
		testenv.WaitFor(t, "the registration", func() bool { return strings.Contains(out.String(), "registered") })
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("--cluster %s: %v", ep, err)
		}
	}
}

// workers undrain makes a drained worker routable again.
func TestWorkersUndrain(t *testing.T) {
	base := adminServer(t, "")
	ctl("workers", "add", "http://127.0.0.1:9101", "--admin", base)
	if code, out, errs := ctl("workers", "drain", "0", "--admin", base); code != 0 || !strings.Contains(out, "(draining)") {
		t.Fatalf("drain: %d %q %q", code, out, errs)
	}
	code, out, errs := ctl("workers", "undrain", "0", "--admin", base)
	if code != 0 || !strings.Contains(out, "undrained: slot 0 http://127.0.0.1:9101 (healthy)") {
		t.Fatalf("undrain: %d %q %q", code, out, errs)
	}
	if _, out, _ := ctl("workers", "list", "--json", "--admin", base); !strings.Contains(out, `"state":"healthy"`) {
		t.Fatalf("after undrain: %s", out)
	}
	if code, _, errs := ctl("workers", "undrain", "--admin", base); code != 2 || !strings.Contains(errs, "wants one argument") {
		t.Errorf("undrain without an id: %d %q", code, errs)
	}
	if code, _, errs := ctl("workers", "undrain", "5", "--admin", base); code != 1 || !strings.Contains(errs, "404") {
		t.Errorf("undrain of an empty slot: %d %q", code, errs)
	}
}

// status says which slots hold a worker now: counters left in the pinned
// maps by a worker of an earlier run are marked stale, a worker added now
// is listed before it has a counter.
func TestStatusCurrentWorkers(t *testing.T) {
	base := adminServer(t, "")
	ctl("workers", "add", "http://127.0.0.1:9101", "--admin", base) // slot 0
	ac, err := newAdminClient(base, "", testTimeout)
	if err != nil {
		t.Fatal(err)
	}
	// Slot 7: counters from an earlier run, no worker now.
	st := &Status{Workers: []WorkerStatus{{Slot: 7, Requests: 40, Errors: 1}}}
	if err := st.readCurrent(ac); err != nil {
		t.Fatal(err)
	}
	if !st.CurrentKnown || len(st.Workers) != 2 || st.Workers[0].Slot != 0 || st.Workers[1].Slot != 7 ||
		st.Workers[0].Current == nil || !*st.Workers[0].Current || st.Workers[0].URL != "http://127.0.0.1:9101" || st.Workers[0].State != "healthy" ||
		st.Workers[1].Current == nil || *st.Workers[1].Current {
		b, _ := json.Marshal(st.Workers)
		t.Fatalf("workers: %s", b)
	}
	var out bytes.Buffer
	if err := st.print(&out); err != nil {
		t.Fatal(err)
	}
	text := out.String()
	t.Logf("\n%s", text)
	for _, re := range []string{
		`(?m)^SLOT\s+IN_FLIGHT.*CONNS\s+WORKER NOW$`,
		`(?m)^0\s+0\s+0\s+0\s+0\s+0\s+0\s+0\s+http://127\.0\.0\.1:9101 \(healthy\)$`,
		`(?m)^7\s+0\s+40\s+1\s+0\s+0\s+0\s+0\s+\(none: stale counters\)$`,
		`(?m)^1 slot holds no worker now`,
	} {
		if !regexp.MustCompile(re).MatchString(text) {
			t.Errorf("no match for %s", re)
		}
	}

	// The admin API down: not known, and said why.
	st = &Status{Workers: []WorkerStatus{{Slot: 7, Requests: 40}}}
	dead, _ := newAdminClient("127.0.0.1:1", "", testTimeout)
	if err := st.readCurrent(dead); err == nil {
		t.Fatal("no error from a dead admin API")
	} else {
		st.CurrentError = err.Error()
	}
	out.Reset()
	st.print(&out)
	if text := out.String(); !strings.Contains(text, "which slots hold a worker now: not known") || strings.Contains(text, "WORKER NOW") {
		t.Errorf("admin API down:\n%s", text)
	}
}

// End to end with the pinned maps: slot 7's counters (tetherd helper)
// belong to no worker of the admin API's; slot 0 is the current worker.
func TestStatusCurrentPinned(t *testing.T) {
	testenv.RequireBPF(t)
	_, _, pin := tetherd(t, 1)
	base := adminServer(t, "")
	ctl("workers", "add", "http://127.0.0.1:9101", "--admin", base)
	var out bytes.Buffer
	code := run([]string{"status", "--json", "--pin-dir", pin, "--admin", strings.TrimPrefix(base, "http://")}, &out, &out)
	var st Status
	if err := json.Unmarshal(out.Bytes(), &st); code != 0 || err != nil {
		t.Fatalf("status: %d %v\n%s", code, err, out.String())
	}
	cur := map[int]bool{}
	for _, w := range st.Workers {
		if w.Current == nil {
			t.Fatalf("slot %d: current not known: %s", w.Slot, out.String())
		}
		cur[w.Slot] = *w.Current
	}
	if len(cur) != 2 || !cur[0] || cur[7] || !st.CurrentKnown {
		t.Fatalf("current %v: %s", cur, out.String())
	}
}
