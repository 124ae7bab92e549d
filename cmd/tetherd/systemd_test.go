package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/demo"
)

// notifyServer is systemd's side of the notify protocol, for tests: a
// unixgram socket that collects the messages and the descriptors stored
// with FDSTORE=1 (the fd store).
type notifyServer struct {
	conn  *net.UnixConn
	path  string
	store map[string]*os.File
}

func newNotifyServer(t *testing.T) *notifyServer {
	path := filepath.Join(t.TempDir(), "notify")
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &notifyServer{conn: c, path: path, store: map[string]*os.File{}}
}

// next returns the next message, keeping stored descriptors by FDNAME.
func (n *notifyServer) next(t *testing.T) string {
	t.Helper()
	n.conn.SetReadDeadline(time.Now().Add(15 * time.Second))
	buf, oob := make([]byte, 4096), make([]byte, unix.CmsgSpace(16*4))
	k, oobn, _, _, err := n.conn.ReadMsgUnix(buf, oob)
	if err != nil {
		t.Fatalf("notify socket: %v", err)
	}
	msg := string(buf[:k])
	if oobn > 0 && strings.Contains(msg, "BARRIER=1") {
		// As systemd does: the barrier's descriptor is closed once read.
		msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
		for _, m := range msgs {
			fds, _ := unix.ParseUnixRights(&m)
			for _, fd := range fds {
				unix.Close(fd)
			}
		}
		oobn = 0
	}
	if oobn > 0 {
		msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
		for _, m := range msgs {
			fds, _ := unix.ParseUnixRights(&m)
			name := ""
			for _, l := range strings.Split(msg, "\n") {
				if v, ok := strings.CutPrefix(l, "FDNAME="); ok {
					name = v
				}
			}
			for _, fd := range fds {
				if _, dup := n.store[name]; dup {
					unix.Close(fd) // systemd keeps one copy of a socket
					continue
				}
				n.store[name] = os.NewFile(uintptr(fd), name)
			}
		}
	}
	return msg
}

// waitFor reads messages until one contains want.
func (n *notifyServer) waitFor(t *testing.T, want string) string {
	t.Helper()
	for {
		if m := n.next(t); strings.Contains(m, want) {
			return m
		}
	}
}

// TestSystemdProtocol runs tetherd as systemd would with Type=notify: it
// says READY=1 with its MAINPID and parks its sockets in the fd store; an
// upgrade's new process says MAINPID= itself; SIGTERM says STOPPING=1.
// Then a restart: while no tetherd runs, a client connects (the stored
// socket keeps it in the backlog instead of refusing it), and the tetherd
// started with the stored sockets (LISTEN_FDS, as systemd passes them)
// answers it.
func TestSystemdProtocol(t *testing.T) {
	if testing.Short() {
		t.Skip("builds tetherd")
	}
	bin := build(t, t.TempDir(), "github.com/tether-rl/tether/cmd/tetherd")
	w, err := demo.Start("127.0.0.1:0", demo.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	ns := newNotifyServer(t)
	args := []string{"--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--listeners", "2", "--bpf", "off", "--worker", w.URL()}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(os.Environ(), "NOTIFY_SOCKET="+ns.path)
	logf, err := os.Create(filepath.Join(t.TempDir(), "tetherd.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	cmd.Stderr = logf // a file: no copying goroutine to wait for
	t.Cleanup(func() {
		if t.Failed() {
			b, _ := os.ReadFile(logf.Name())
			t.Logf("tetherd's log:\n%s", b)
		}
	})
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	ready := ns.waitFor(t, "READY=1")
	if !strings.Contains(ready, "MAINPID="+strconv.Itoa(cmd.Process.Pid)) {
		t.Fatalf("ready message %q", ready)
	}
	for len(ns.store) < 3 {
		ns.next(t)
	}
	for _, name := range []string{"data-0", "data-1", "admin"} {
		if ns.store[name] == nil {
			t.Fatalf("fd store: %v, want data-0, data-1, admin", ns.store)
		}
	}
	ln, err := net.FileListener(ns.store["data-0"])
	if err != nil {
		t.Fatal(err)
	}
	data := ln.Addr().String()
	ln.Close()

	// Upgrade: the new process is the main one now.
	cmd.Process.Signal(syscall.SIGUSR2)
	m := ns.waitFor(t, "MAINPID=")
	newPid, _ := strconv.Atoi(strings.TrimSpace(strings.SplitN(strings.SplitN(m, "MAINPID=", 2)[1], "\n", 2)[0]))
	if newPid == 0 || newPid == cmd.Process.Pid {
		t.Fatalf("after upgrade: %q", m)
	}
	// The old process retires and exits (its stderr pipe lives on in the
	// new process, so cmd.Wait would wait for that one too).
	waitExit(t, cmd.Process.Pid)
	// Load through the stop and the start: keep-alive requests and a new
	// connection per request, none may fail.
	var failed, okN atomic.Int64
	var firstErr atomic.Value
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tr := &http.Transport{}
			if i%2 == 1 {
				tr.DisableKeepAlives = true
			}
			c := &http.Client{Transport: tr, Timeout: 30 * time.Second}
			for {
				select {
				case <-stop:
					return
				default:
				}
				resp, err := c.Post("http://"+data+"/v1/chat/completions", "application/json",
					strings.NewReader(`{"messages":[{"role":"user","content":"hi"}]}`))
				if err == nil {
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != 200 {
						err = fmt.Errorf("status %d", resp.StatusCode)
					}
				}
				if err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
					continue
				}
				okN.Add(1)
			}
		}()
	}
	time.Sleep(200 * time.Millisecond)
	syscall.Kill(newPid, syscall.SIGTERM)
	ns.waitFor(t, "STOPPING=1")
	waitExit(t, newPid)
	before := okN.Load()

	// No tetherd runs (systemd's RestartSec): a client connects and sends
	// its request anyway.
	c, err := net.DialTimeout("tcp", data, 2*time.Second)
	if err != nil {
		t.Fatalf("connect while stopped: %v (refused: the fd store did not keep the socket)", err)
	}
	defer c.Close()
	fmt.Fprintf(c, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
	time.Sleep(300 * time.Millisecond)

	// Restart with the stored sockets, as systemd passes them.
	names := []string{"data-0", "data-1", "admin"}
	var files []*os.File
	for _, n := range names {
		files = append(files, ns.store[n])
	}
	re := exec.CommandContext(ctx, "sh", "-c", `LISTEN_PID=$$ exec "$0" "$@"`, bin)
	re.Args = append(re.Args, args...)
	re.Env = append(os.Environ(), "LISTEN_FDS=3", "LISTEN_FDNAMES="+strings.Join(names, ":"))
	re.ExtraFiles = files
	re.Stderr = logf
	if err := re.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { re.Process.Signal(syscall.SIGTERM); re.Wait() }()
	c.SetReadDeadline(time.Now().Add(30 * time.Second))
	b, err := io.ReadAll(c)
	if err != nil || !strings.HasPrefix(string(b), "HTTP/1.1 200") {
		t.Fatalf("request sent while stopped: %v %q", err, b)
	}
	for deadline := time.Now().Add(20 * time.Second); okN.Load() < before+50; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			close(stop)
			wg.Wait()
			t.Fatalf("no load served after the start (%d failed, first: %v)", failed.Load(), firstErr.Load())
		}
	}
	close(stop)
	wg.Wait()
	t.Logf("stop + start under load: %d requests ok (%d after the start), %d failed", okN.Load(), okN.Load()-before, failed.Load())
	if failed.Load() != 0 {
		t.Errorf("%d requests failed across stop + start, first: %v", failed.Load(), firstErr.Load())
	}
}

// waitExit waits (bounded) for a process to exit.
func waitExit(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for alive(pid) {
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGQUIT) // its goroutines, in its log
			time.Sleep(200 * time.Millisecond)
			t.Fatalf("tetherd %d did not exit", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
