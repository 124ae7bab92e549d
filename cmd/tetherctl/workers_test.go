package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/admin"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/stats"
)

func adminServer(t *testing.T, token string) string {
	t.Helper()
	reg := registry.New(registry.Options{
		Stats: stats.NewHeap(),
		Probe: func(_ context.Context, u string) error {
			if strings.HasSuffix(u, ":1") {
				return errors.New("refused")
			}
			return nil
		},
		Config: registry.Config{StartupTimeout: 100 * time.Millisecond},
		Log:    slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	srv := httptest.NewServer(admin.New(admin.Config{Registry: reg, Token: token}))
	t.Cleanup(func() { srv.Close(); reg.Close() })
	return srv.URL
}

func ctl(args ...string) (int, string, string) {
	var out, errb bytes.Buffer
	code := run(args, &out, &errb)
	return code, out.String(), errb.String()
}

func TestWorkersVerbs(t *testing.T) {
	base := adminServer(t, "")
	a := []string{"--admin", base}
	if code, out, errs := ctl(append([]string{"workers", "add", "http://127.0.0.1:9101"}, a...)...); code != 0 || !strings.Contains(out, "added: slot 0 http://127.0.0.1:9101 (healthy)") {
		t.Fatalf("add: %d %q %q", code, out, errs)
	}
	ctl(append([]string{"workers", "add", "http://127.0.0.1:9102"}, a...)...)
	code, out, _ := ctl(append([]string{"workers", "list"}, a...)...)
	if code != 0 || !strings.Contains(out, "SLOT") || !strings.Contains(out, "http://127.0.0.1:9102") || !strings.Contains(out, "2 workers, 2 healthy") {
		t.Fatalf("list: %d %q", code, out)
	}
	if code, out, _ := ctl(append([]string{"workers", "drain", "1"}, a...)...); code != 0 || !strings.Contains(out, "draining: slot 1") {
		t.Fatalf("drain: %d %q", code, out)
	}
	if code, out, _ := ctl(append([]string{"workers", "remove", "http://127.0.0.1:9101"}, a...)...); code != 0 || !strings.Contains(out, "removed: slot 0") {
		t.Fatalf("remove by url: %d %q", code, out)
	}
	if code, out, _ := ctl(append([]string{"workers", "list", "--json"}, a...)...); code != 0 || !strings.HasPrefix(out, `{"workers":`) {
		t.Fatalf("list --json: %d %q", code, out)
	}
	// Failures: the API's message, exit 1; bad usage: exit 2.
	for _, c := range []struct {
		args []string
		code int
		msg  string
	}{
		{[]string{"workers", "remove", "7"}, 1, "slot 7 is empty (HTTP 404)"},
		{[]string{"workers", "add", "https://x:2"}, 1, "https backends are not supported"},
		{[]string{"workers", "add", "http://127.0.0.1:1"}, 1, "did not become healthy"},
		{[]string{"workers", "add"}, 2, "wants one argument"},
		{[]string{"workers", "list", "x"}, 2, "takes no argument"},
		{[]string{"workers", "frob"}, 2, "unknown subcommand"},
	} {
		code, _, errs := ctl(append(c.args, a...)...)
		if code != c.code || !strings.Contains(errs, c.msg) {
			t.Errorf("%v: %d %q, want %d %q", c.args, code, errs, c.code, c.msg)
		}
	}
	if code, _, errs := ctl("workers"); code != 2 || !strings.Contains(errs, "want a subcommand") {
		t.Errorf("no subcommand: %d %q", code, errs)
	}
	if code, _, errs := ctl("workers", "list", "--admin", "127.0.0.1:1"); code != 1 || !strings.Contains(errs, "admin API") {
		t.Errorf("unreachable admin: %d %q", code, errs)
	}
}

func TestWorkersToken(t *testing.T) {
	base := adminServer(t, "tok")
	if code, _, errs := ctl("workers", "list", "--admin", base); code != 1 || !strings.Contains(errs, "401") {
		t.Fatalf("no token: %d %q", code, errs)
	}
	if code, _, errs := ctl("workers", "list", "--admin", base, "--token", "tok"); code != 0 {
		t.Fatalf("--token: %d %q", code, errs)
	}
	t.Setenv("TETHER_ADMIN_TOKEN", "tok")
	if code, _, errs := ctl("workers", "list", "--admin", strings.TrimPrefix(base, "http://")); code != 0 {
		t.Fatalf("$TETHER_ADMIN_TOKEN, admin without scheme: %d %q", code, errs)
	}
}
