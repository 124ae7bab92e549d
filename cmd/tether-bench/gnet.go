package main

import (
	"context"
	"crypto/sha256"
	_ "embed"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// gnet v2, the best-known Go event-loop library, as a measured peer
// ("gnet-exp"): the keep-alive path of the benchmark written on it the way
// it is meant to be used (gnet_main.go.txt), built in a module of its own
// (never in tether's go.mod) and cached like caddy. It answers the
// question the event-loop issue asks (a library's loop or tether's own?)
// with numbers. tether's loop puts a client socket and its upstream socket
// in the same epoll set; with gnet the upstream connections live on a
// gnet.Client's loops, and every request and response crosses loops
// through AsyncWrite.

const gnetVersion = "v2.9.7"

//go:embed gnet_main.go.txt
var gnetMain string

// buildGnet returns the cached gnet-exp binary, building it first.
func buildGnet(ctx context.Context) (string, error) {
	return buildPeer(ctx, "gnet-"+gnetVersion, "gnet-exp", gnetMain, "github.com/panjf2000/gnet/v2@"+gnetVersion)
}

// buildPeer builds src as main.go in a module of its own under the user's
// cache directory, requiring path@version, once per version of src.
func buildPeer(ctx context.Context, dirName, binName, src, require string) (string, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	dir := filepath.Join(cache, "tether-bench", dirName, fmt.Sprintf("%x", sha256.Sum256([]byte(src)))[:12])
	bin := filepath.Join(dir, binName)
	if _, err := os.Stat(bin); err == nil {
		return bin, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module tether-bench-"+binName+"\n\ngo 1.26\n"), 0o644); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(src), 0o644); err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(ctx, 15*time.Minute)
	defer cancel()
	for _, args := range [][]string{{"get", require}, {"mod", "tidy"}, {"build", "-o", bin + ".tmp", "."}} {
		cmd := exec.CommandContext(ctx, "go", args...)
		cmd.Dir = dir
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
		if out, err := cmd.CombinedOutput(); err != nil {
			return "", fmt.Errorf("go %s (%s): %v: %s", strings.Join(args, " "), binName, err, lastLine(string(out)))
		}
	}
	return bin, os.Rename(bin+".tmp", bin)
}

func (b *bench) startGnet() (*instance, error) {
	var ws []string
	for _, p := range b.workerPorts {
		ws = append(ws, fmt.Sprintf("127.0.0.1:%d", p))
	}
	p, port, err := b.m.startServer(b.ctx, "gnet-exp", b.gnetBin, func(port int) ([]string, error) {
		return []string{"--listen", fmt.Sprintf("127.0.0.1:%d", port), "--workers", strings.Join(ws, ",")}, nil
	}, "/health")
	if err != nil {
		return nil, err
	}
	return &instance{port: port, procs: []*proc{p}, stop: func() { b.m.stop(p) }}, nil
}
