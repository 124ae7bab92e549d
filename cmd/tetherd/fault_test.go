package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/demo"
)

// cpuTicks returns a process's user+system CPU time in clock ticks.
func cpuTicks(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		t.Fatal(err)
	}
	// Fields after the command (which may hold spaces): state is field 3.
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
	u, _ := strconv.ParseInt(f[11], 10, 64)
	s, _ := strconv.ParseInt(f[12], 10, 64)
	return u + s
}

// tetherd out of descriptors (ulimit -n 160, the connection cap lifted so
// that accept itself runs out): 400 offered connections do not crash it or
// make it spin, do not mark the workers down, streams already running
// finish whole, and service resumes once the clients leave.
func TestOutOfDescriptors(t *testing.T) {
	if testing.Short() {
		t.Skip("builds binaries")
	}
	bin := build(t, t.TempDir(), "github.com/tether-rl/tether/cmd/tetherd")
	var urls []string
	for i := range 2 {
		w, err := demo.Start("127.0.0.1:0", demo.Options{Index: i})
		if err != nil {
			t.Fatal(err)
		}
		defer w.Close()
		urls = append(urls, w.URL())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "sh", "-c", `ulimit -n 160 && exec "$0" "$@"`, bin,
		"--listen", "127.0.0.1:0", "--admin", "off", "--bpf", "off", "--listeners", "1",
		"--max-conns", "100000", "--health-interval", "200ms",
		"--worker", urls[0], "--worker", urls[1])
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	var logs logWatch
	go logs.run(stderr)
	addr := logs.wait(t, `msg="tetherd serving" listen=(\S+)`)
	pid := cmd.Process.Pid

	// Four streams of 20 events 100 ms apart, running before the flood.
	type stream struct {
		c  net.Conn
		br *bufio.Reader
	}
	var streams []stream
	for i := range 4 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(60 * time.Second))
		fmt.Fprintf(c, "POST /sessions/w%d-%032x/slow?chunks=20&delay_ms=100 HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n", i%2, i)
		br := bufio.NewReader(c)
		if _, err := br.Peek(1); err != nil {
			t.Fatalf("stream %d: %v", i, err)
		}
		streams = append(streams, stream{c, br})
	}

	// The flood: 400 connections, each sending a request.
	var flood []net.Conn
	for range 400 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("connect: %v", err)
		}
		io.WriteString(c, "GET /sessions/w0-0/ping HTTP/1.1\r\nHost: t\r\n\r\n")
		flood = append(flood, c)
	}
	defer func() {
		for _, c := range flood {
			c.Close()
		}
	}()
	logs.wait(t, `accept failing.*too many open files`)
	t0, c0 := time.Now(), cpuTicks(t, pid)
	time.Sleep(time.Second) // the span over which CPU use is measured
	ticks, span := cpuTicks(t, pid)-c0, time.Since(t0)
	t.Logf("out of descriptors: %d ticks of CPU in %v (100 per second)", ticks, span)
	// 100 ticks per second: a spinning accept loop would burn ~100.
	if ticks > 30 {
		t.Errorf("tetherd used %d ticks of CPU in %v while out of descriptors: spinning", ticks, span)
	}

	for i, s := range streams {
		resp, err := http.ReadResponse(s.br, nil)
		if err != nil {
			t.Fatalf("stream %d: %v", i, err)
		}
		b, err := io.ReadAll(resp.Body)
		if err != nil || strings.Count(string(b), "data:") < 20 {
			t.Fatalf("stream %d cut during the flood: %v, %d events", i, err, strings.Count(string(b), "data:"))
		}
	}
	for _, c := range flood {
		c.Close()
	}
	flood = nil
	client := &http.Client{Timeout: 5 * time.Second}
	testenv.WaitFor(t, "service after the flood", func() bool {
		resp, err := client.Get("http://" + addr + "/health")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})
	for i := range 20 {
		resp, err := client.Post("http://"+addr+"/sessions/w"+strconv.Itoa(i%2)+"-abc/echo", "text/plain", strings.NewReader("hi"))
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("request %d after the flood: %v %v", i, err, resp)
		}
		resp.Body.Close()
	}
	if n := logs.count(`accept failing`); n > 10 {
		t.Errorf("%d accept-failure lines for one flood: not once per episode", n)
	}
	if n := logs.count(`unhealthy|panic`); n > 0 {
		t.Log(strings.Join(logs.lines, "\n"))
		t.Errorf("the workers were blamed for tetherd's descriptors: %d lines", n)
	}
	if cmd.ProcessState != nil {
		t.Fatal("tetherd exited")
	}
}
