package upgrade

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func script(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "child")
	if err := os.WriteFile(p, []byte("#!/bin/sh\n"+body), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// The child sees the files by name at fds 3.., and the old process learns
// it is ready only from the pipe; a child that exits or stays silent is
// ErrNotReady (and a silent one is killed).
func TestStart(t *testing.T) {
	mem, err := Memfd("state", []byte("hello"))
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	files := []File{{Name: "state", File: mem}}
	// Ready: reads its state at fd 3, answers on the fd named by the env.
	ok := script(t, `[ "$TETHER_UPGRADE_FDS" = state ] || exit 7
[ "$(cat <&3)" = hello ] || exit 8
echo ready >&"$TETHER_UPGRADE_READY"
sleep 0.2`)
	p, err := Start(ok, nil, files, os.Stderr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if p.Pid <= 0 {
		t.Fatal("no pid")
	}
	mem.Seek(0, 0)
	if _, err := Start(script(t, "exit 3"), nil, files, os.Stderr, 5*time.Second); !errors.Is(err, ErrNotReady) {
		t.Fatalf("exiting child: %v", err)
	}
	start := time.Now()
	if _, err := Start(script(t, "exec sleep 30"), nil, files, os.Stderr, 300*time.Millisecond); !errors.Is(err, ErrNotReady) || time.Since(start) > 5*time.Second {
		t.Fatalf("silent child: %v after %v", err, time.Since(start))
	}
	if _, err := Start(script(t, "exit 0"), nil, []File{{Name: "a:b", File: mem}}, os.Stderr, time.Second); err == nil {
		t.Fatal("a name with ':' was accepted")
	}
}

// Without the environment of an upgrade, Inherit returns nil and Ready
// does nothing.
func TestInheritNone(t *testing.T) {
	t.Setenv(envReady, "")
	in, err := Inherit()
	if err != nil || in != nil {
		t.Fatalf("%v %v", in, err)
	}
	if err := in.Ready(); err != nil || in.Take("x") != nil {
		t.Fatal("nil Inherited misbehaves")
	}
}
