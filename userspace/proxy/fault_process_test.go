package proxy

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
)

// Faults of a real worker process: killed (SIGKILL) in the middle of a
// response, or stopped (SIGSTOP) before or during one. The worker is this
// test binary re-executed (faultBackend); the client is net/http's, as an
// RL stack's would be.

const faultBackendEnv = "TETHER_FAULT_BACKEND"

// faultBackend serves one response shape per path, sends the first part,
// then hangs until killed: /cl (Content-Length), /chunked, /sse, /close
// (close-delimited), /silent (no answer at all).
func faultBackend() {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	fmt.Println(ln.Addr())
	part := strings.Repeat("a", 1000)
	for {
		c, err := ln.Accept()
		if err != nil {
			os.Exit(0)
		}
		go func() {
			br := bufio.NewReader(c)
			line, _ := br.ReadString('\n')
			for {
				l, err := br.ReadString('\n')
				if err != nil || l == "\r\n" {
					break
				}
			}
			path := strings.Fields(line + " x x")[1]
			switch path {
			case "/cl":
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n"+part)
			case "/chunked":
				io.WriteString(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n"+part+"\r\n")
			case "/sse":
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
			case "/close":
				io.WriteString(c, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n"+part)
			}
			select {} // hang until killed or stopped
		}()
	}
}

// startFaultBackend runs faultBackend in its own process.
func startFaultBackend(t *testing.T) (*os.Process, string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), faultBackendEnv+"=1")
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGCONT)
		cmd.Process.Kill()
		cmd.Wait()
	})
	addr, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("fault backend: %v", err)
	}
	return cmd.Process, strings.TrimSpace(addr)
}

// A worker killed mid-response: every framing shows the cut to the
// client. Content-Length: fewer bytes than announced; chunked and SSE: no
// last chunk; close-delimited and reset by the worker's kernel: a
// connection reset (SO_LINGER 0), never a clean end. Either way net/http's
// body read fails.
func TestWorkerKilledMidResponse(t *testing.T) {
	for _, path := range []string{"/cl", "/chunked", "/sse", "/close"} {
		t.Run(path[1:], func(t *testing.T) {
			testenv.CheckLeaks(t)
			proc, addr := startFaultBackend(t)
			p := startProxy(t, []string{addr}, nil)
			tr := &http.Transport{}
			defer tr.CloseIdleConnections()
			// The close-delimited case sends a body the worker does not
			// read: its kernel then resets the connection when it dies
			// (after a clean FIN a close-delimited body is complete to
			// anyone, tetherd included; see docs/ARCHITECTURE.md).
			body := io.Reader(nil)
			if path == "/close" {
				body = strings.NewReader(strings.Repeat("b", 256<<10))
			}
			resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Post("http://"+p.addr()+path, "text/plain", body)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			first := make([]byte, 9)
			if _, err := io.ReadFull(resp.Body, first); err != nil {
				t.Fatalf("first bytes: %v", err)
			}
			proc.Kill()
			rest, err := io.ReadAll(resp.Body)
			if err == nil {
				t.Fatalf("the cut looked complete: %d more bytes, no error", len(rest))
			}
			if path == "/close" && !errors.Is(err, syscall.ECONNRESET) {
				t.Fatalf("close-delimited cut: %v, want a connection reset", err)
			}
			if path != "/close" && !errors.Is(err, io.ErrUnexpectedEOF) {
				t.Fatalf("cut: %v, want unexpected EOF", err)
			}
			testenv.WaitFor(t, "the truncation counted", func() bool { return p.srv.Counters().Truncated.Load() == 1 })
		})
	}
}

// A stopped worker (SIGSTOP: its kernel still accepts connections) costs
// its clients the first-byte timeout (504) before it answered, the stream
// idle timeout (a visible cut) after.
func TestWorkerStopped(t *testing.T) {
	testenv.CheckLeaks(t)
	proc, addr := startFaultBackend(t)
	p := startProxy(t, []string{addr}, func(c *Config) {
		c.ResponseTimeout = 300 * time.Millisecond
		c.StreamIdleTimeout = 300 * time.Millisecond
	})
	client := &http.Client{Transport: &http.Transport{}, Timeout: 10 * time.Second}
	defer client.CloseIdleConnections()

	resp, err := client.Get("http://" + p.addr() + "/sse")
	if err != nil {
		t.Fatal(err)
	}
	first := make([]byte, 9)
	if _, err := io.ReadFull(resp.Body, first); err != nil {
		t.Fatalf("first event: %v", err)
	}
	proc.Signal(syscall.SIGSTOP)
	start := time.Now()
	_, err = io.ReadAll(resp.Body)
	resp.Body.Close()
	if !errors.Is(err, io.ErrUnexpectedEOF) || time.Since(start) > 5*time.Second {
		t.Fatalf("stream of a stopped worker: %v after %v, want a cut after ~300ms", err, time.Since(start))
	}

	start = time.Now()
	resp, err = client.Get("http://" + p.addr() + "/silent")
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 504 || resp.Header.Get(UpstreamStateHeader) != "sent" || time.Since(start) > 5*time.Second {
		t.Fatalf("stopped worker: %d %s after %v, want 504 sent after ~300ms", resp.StatusCode, resp.Header.Get(UpstreamStateHeader), time.Since(start))
	}
}
