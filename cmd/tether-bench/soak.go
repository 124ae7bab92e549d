package main

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/userspace/demo"
)

// The soak phase (make soak): overload and fault scenarios, each on a fresh
// instance of tetherd and of nginx, with the figures an operator asks for:
// held throughput, failures, RSS, CPU. It is bounded in time (each
// scenario stops itself) and needs no root.

const soakHeadTimeout = 10 * time.Second

type soakRow struct {
	scenario, target string
	cells            []string
}

// soakTargets are the targets the soak runs on: tetherd, and nginx when
// installed.
func (b *bench) soakTargets() []*target {
	var ts []*target
	for _, n := range []string{"tetherd", "nginx"} {
		if t := b.targetByName(n); t != nil && b.active(t) {
			ts = append(ts, t)
		}
	}
	return ts
}

func (b *bench) phaseSoak() []soakRow {
	var rows []soakRow
	scenarios := []struct {
		name string
		run  func(t *target, in *instance) []string
	}{
		{"slowloris", b.soakSlowloris},
		{"idle", b.soakIdle},
		{"slow readers", b.soakSlowReaders},
		{"big bodies", b.soakBig},
	}
	for _, sc := range scenarios {
		if len(b.o.soakOnly) > 0 && !b.o.soakOnly[sc.name] {
			continue
		}
		for _, t := range b.soakTargets() {
			if b.ctx.Err() != nil {
				return rows
			}
			in, ok := b.startTarget(t)
			if !ok {
				continue
			}
			logf("soak %s: %s", sc.name, t.name)
			cells := sc.run(t, in)
			in.stop()
			logf("soak %s %s: %s", sc.name, t.name, strings.Join(cells, " | "))
			rows = append(rows, soakRow{sc.name, t.name, cells})
		}
	}
	for _, t := range b.soakTargets() {
		if b.ctx.Err() != nil || len(b.o.soakOnly) > 0 && !b.o.soakOnly["fd limit"] {
			break
		}
		logf("soak fd limit: %s", t.name)
		rows = append(rows, soakRow{"fd limit", t.name, b.soakFDLimit(t)})
		logf("soak fd limit %s: %s", t.name, strings.Join(rows[len(rows)-1].cells, " | "))
	}
	return rows
}

// treeRSS returns the resident memory (bytes) of the processes and their
// descendants.
func treeRSS(roots ...int) int64 {
	var total int64
	for _, pid := range descendants(roots...) {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "VmRSS:") {
				f := strings.Fields(line)
				kb, _ := strconv.ParseInt(f[1], 10, 64)
				total += kb << 10
			}
		}
	}
	return total
}

// descendants returns roots and every process below them.
func descendants(roots ...int) []int {
	ents, _ := os.ReadDir("/proc")
	children := map[int][]int{}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if st, ok := readStat(pid); ok {
			children[st.ppid] = append(children[st.ppid], pid)
		}
	}
	var out []int
	seen := map[int]bool{}
	queue := append([]int(nil), roots...)
	for len(queue) > 0 {
		pid := queue[0]
		queue = queue[1:]
		if !seen[pid] {
			seen[pid] = true
			out = append(out, pid)
			queue = append(queue, children[pid]...)
		}
	}
	return out
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// wrkRate runs wrk on session paths for d and returns req/s and failures.
func (b *bench) wrkRate(t *target, in *instance, conns int, d time.Duration) (float64, int64) {
	script, err := writeWrkScript(b.m.tmp, "wrk-soak-"+t.name, b.idsFor(t), false)
	if err != nil {
		return 0, -1
	}
	res, err := runWrk(b.ctx, b.wrkBin, fmt.Sprintf("http://127.0.0.1:%d", in.port), script, b.o.threads, conns, d)
	if err != nil {
		logf("!!! wrk: %v", firstLine(err.Error()))
		return 0, -1
	}
	return res.rps, res.errSocket + res.errStatus
}

// soakSlowloris: 2,000 connections send a head one field every 2 s (never
// finishing it) while wrk measures what legitimate clients still get:
// slowhttptest -H when installed (Debian's), else a built-in equivalent.
func (b *bench) soakSlowloris(t *target, in *instance) []string {
	if bin, err := exec.LookPath("slowhttptest"); err == nil {
		return b.soakSlowhttptest(t, in, bin)
	}
	base, _ := b.wrkRate(t, in, 32, 3*time.Second)
	rss0 := treeRSS(in.pids()...)
	const n = 2000
	ctx, cancel := context.WithTimeout(b.ctx, soakHeadTimeout+15*time.Second)
	defer cancel()
	var got408, closed, opened atomic.Int64
	var wg sync.WaitGroup
	addr := fmt.Sprintf("127.0.0.1:%d", in.port)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := net.DialTimeout("tcp", addr, 5*time.Second)
			if err != nil {
				return
			}
			defer c.Close()
			opened.Add(1)
			go func() { <-ctx.Done(); c.Close() }()
			done := make(chan struct{})
			go func() {
				defer close(done)
				line, err := bufio.NewReader(c).ReadString('\n')
				if strings.Contains(line, " 408 ") {
					got408.Add(1)
				}
				if err == nil || ctx.Err() == nil {
					closed.Add(1)
				}
			}()
			fmt.Fprintf(c, "GET /sessions/%s/x HTTP/1.1\r\nHost: x\r\n", b.ids[0][0])
			tick := time.NewTicker(2 * time.Second)
			defer tick.Stop()
			for {
				select {
				case <-done:
					return
				case <-ctx.Done():
					return
				case <-tick.C:
					if _, err := io.WriteString(c, "X-Slow: 1\r\n"); err != nil {
						<-done
						return
					}
				}
			}
		}()
	}
	time.Sleep(2 * time.Second) // let them all connect
	under, fails := b.wrkRate(t, in, 32, 3*time.Second)
	rss1 := treeRSS(in.pids()...)
	// Wait for the head timeout to close them.
	deadline := time.Now().Add(soakHeadTimeout + 10*time.Second)
	for closed.Load() < opened.Load() && time.Now().Before(deadline) && b.ctx.Err() == nil {
		time.Sleep(100 * time.Millisecond)
	}
	cancel()
	wg.Wait()
	held := 0.0
	if base > 0 {
		held = under / base
	}
	return []string{
		fmt.Sprintf("%.0f → %.0f req/s (held %.0f%%), %d failed", base, under, 100*held, fails),
		fmt.Sprintf("%d/%d slow connections closed by the proxy within head timeout + 10 s, %d with a 408", closed.Load(), opened.Load(), got408.Load()),
		"RSS +" + mib(rss1-rss0),
	}
}

var (
	ansiRe  = regexp.MustCompile("\x1b\\[[0-9;]*m")
	slowRe  = regexp.MustCompile(`(connected|closed|error):\s+(\d+)`)
	endedRe = regexp.MustCompile(`Test ended on (\d+)`)
	exitRe  = regexp.MustCompile(`Exit status:\s*([^\n]*)`)
)

// soakSlowhttptest runs slowhttptest in slowloris mode (2,000 connections,
// a header line every 2 s, 25 s) against the target while wrk measures the
// legitimate load's throughput, before and during.
func (b *bench) soakSlowhttptest(t *target, in *instance, bin string) []string {
	base, _ := b.wrkRate(t, in, 32, 3*time.Second)
	rss0 := treeRSS(in.pids()...)
	ctx, cancel := context.WithTimeout(b.ctx, 60*time.Second)
	defer cancel()
	url := fmt.Sprintf("http://127.0.0.1:%d/sessions/%s/x", in.port, b.ids[0][0])
	cmd := exec.CommandContext(ctx, bin, "-c", "2000", "-H", "-i", "2", "-r", "1000", "-l", "25", "-p", "3", "-u", url)
	out := &strings.Builder{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		return []string{"slowhttptest did not start: " + err.Error()}
	}
	time.Sleep(4 * time.Second) // the slow connections open
	under, fails := b.wrkRate(t, in, 32, 3*time.Second)
	rss1 := treeRSS(in.pids()...)
	cmd.Wait()
	text := ansiRe.ReplaceAllString(out.String(), "")
	var maxConnected, closed, errs int
	for _, m := range slowRe.FindAllStringSubmatch(text, -1) {
		n, _ := strconv.Atoi(m[2])
		switch m[1] {
		case "connected":
			maxConnected = max(maxConnected, n)
		case "closed":
			closed = n
		case "error":
			errs = n
		}
	}
	// Its status lines come every 5 s; the end says why it stopped: "No
	// open connections left" means the proxy closed every one.
	ended, exit := "25", "?"
	if m := endedRe.FindStringSubmatch(text); m != nil {
		ended = m[1]
	}
	if m := exitRe.FindStringSubmatch(text); m != nil {
		exit = strings.TrimSpace(m[1])
	}
	if strings.Contains(exit, "No open connections left") {
		closed = maxConnected
	}
	held := 0.0
	if base > 0 {
		held = under / base
	}
	return []string{
		fmt.Sprintf("%.0f → %.0f req/s (held %.0f%%), %d failed", base, under, 100*held, fails),
		fmt.Sprintf("slowhttptest -H -c 2000: up to %d slow connections open at once, %d closed by the proxy, test ended on second %s (%s), %d errors", maxConnected, closed, ended, exit, errs),
		"RSS +" + mib(rss1-rss0),
	}
}

// soakIdle: 10,000 keep-alive connections, each after one request, held
// idle; RSS per connection, and what comes back once they close.
func (b *bench) soakIdle(t *target, in *instance) []string {
	const n = 10000
	addr := fmt.Sprintf("127.0.0.1:%d", in.port)
	rss0 := treeRSS(in.pids()...)
	conns := make([]net.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	failed := 0
	req := []byte("GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
	buf := make([]byte, 4096)
	for i := 0; i < n && b.ctx.Err() == nil; i++ {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			failed++
			continue
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Write(req); err != nil {
			failed++
			c.Close()
			continue
		}
		if k, err := c.Read(buf); err != nil || !strings.Contains(string(buf[:k]), " 200 ") {
			failed++
			c.Close()
			continue
		}
		conns = append(conns, c)
	}
	time.Sleep(5 * time.Second) // settle (RSS after the connections opened)
	rss1 := treeRSS(in.pids()...)
	for _, c := range conns {
		c.Close()
	}
	held := len(conns)
	conns = nil
	time.Sleep(3 * time.Second)
	rss2 := treeRSS(in.pids()...)
	per := 0.0
	if held > 0 {
		per = float64(rss1-rss0) / float64(held) / 1024
	}
	return []string{
		fmt.Sprintf("%d idle connections held (%d failed)", held, failed),
		fmt.Sprintf("RSS +%s (%.2f KiB each)", mib(rss1-rss0), per),
		fmt.Sprintf("after closing: +%s over the start", mib(rss2-rss0)),
	}
}

// soakSlowReaders: 1,000 clients ask for 4 MiB each and read nothing for
// 5 s: what the proxy holds for them.
func (b *bench) soakSlowReaders(t *target, in *instance) []string {
	const n = 1000
	addr := fmt.Sprintf("127.0.0.1:%d", in.port)
	rss0 := treeRSS(in.pids()...)
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := 0; i < n && b.ctx.Err() == nil; i++ {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			continue
		}
		fmt.Fprintf(c, "GET /sessions/%s/blob?size=4194304&seed=%d HTTP/1.1\r\nHost: x\r\n\r\n", b.ids[i%len(b.ids)][0], i)
		conns = append(conns, c)
	}
	time.Sleep(5 * time.Second)
	rss1 := treeRSS(in.pids()...)
	// Then read everything: every body must arrive whole.
	var whole atomic.Int64
	var wg sync.WaitGroup
	sem := make(chan struct{}, 64)
	for _, c := range conns {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			c.SetDeadline(time.Now().Add(60 * time.Second))
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				return
			}
			if k, err := io.Copy(io.Discard, resp.Body); err == nil && k == 4<<20 {
				whole.Add(1)
			}
		}()
	}
	wg.Wait()
	return []string{
		fmt.Sprintf("%d slow readers", len(conns)),
		fmt.Sprintf("RSS +%s while they read nothing (%.1f KiB each)", mib(rss1-rss0), float64(rss1-rss0)/float64(max(1, len(conns)))/1024),
		fmt.Sprintf("%d/%d bodies whole when read", whole.Load(), len(conns)),
	}
}

// soakBig: one -soak-gb body up (sha256 at the worker) and down (sha256 at
// the client), with the proxy's RSS sampled throughout.
func (b *bench) soakBig(t *target, in *instance) []string {
	size := int64(b.o.soakGB) << 30
	const seed = 7
	h := sha256.New()
	io.Copy(h, demo.Blob(size, seed))
	want := hex.EncodeToString(h.Sum(nil))
	base := fmt.Sprintf("http://127.0.0.1:%d/sessions/%s", in.port, b.ids[0][0])
	client := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	defer client.CloseIdleConnections()
	sample := func(f func() (string, error)) (string, int64, time.Duration, error) {
		rss0 := treeRSS(in.pids()...)
		peak := rss0
		stop := make(chan struct{})
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			tk := time.NewTicker(200 * time.Millisecond)
			defer tk.Stop()
			for {
				select {
				case <-stop:
					return
				case <-tk.C:
					if r := treeRSS(in.pids()...); r > peak {
						peak = r
					}
				}
			}
		}()
		start := time.Now()
		sum, err := f()
		d := time.Since(start)
		close(stop)
		wg.Wait()
		return sum, peak - rss0, d, err
	}
	up, upGrow, upD, upErr := sample(func() (string, error) {
		req, _ := http.NewRequestWithContext(b.ctx, "POST", base+"/sha256", demo.Blob(size, seed))
		req.ContentLength = size
		resp, err := client.Do(req)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		var r struct {
			Sha256 string `json:"sha256"`
		}
		body, _ := io.ReadAll(resp.Body)
		if i := strings.Index(string(body), `"sha256":"`); i >= 0 {
			r.Sha256 = string(body[i+10 : i+10+64])
		}
		return r.Sha256, nil
	})
	down, downGrow, downD, downErr := sample(func() (string, error) {
		resp, err := client.Get(fmt.Sprintf("%s/blob?size=%d&seed=%d", base, size, seed))
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		h := sha256.New()
		if _, err := io.Copy(h, resp.Body); err != nil {
			return "", err
		}
		return hex.EncodeToString(h.Sum(nil)), nil
	})
	verdict := func(got string, err error) string {
		switch {
		case err != nil:
			return "FAILED: " + firstLine(err.Error())
		case got == want:
			return "sha256 equal"
		}
		return "SHA256 DIFFERS"
	}
	mbps := func(d time.Duration) float64 { return float64(size) / d.Seconds() / 1e6 }
	return []string{
		fmt.Sprintf("%d GiB up: %s, %.0f MB/s, RSS peak +%s", b.o.soakGB, verdict(up, upErr), mbps(upD), mib(upGrow)),
		fmt.Sprintf("down: %s, %.0f MB/s, RSS peak +%s", verdict(down, downErr), mbps(downD), mib(downGrow)),
	}
}

// soakFDLimit: the proxy under ulimit -n 256 gets 1,000 concurrent wrk
// connections for 5 s; then: does it still serve, and did it blame the
// workers (tetherd: "unhealthy"; nginx: "no live upstreams")?
func (b *bench) soakFDLimit(t *target) []string {
	b.m.noFile = 256
	in, ok := b.startTarget(t)
	b.m.noFile = 0
	if !ok {
		return []string{"did not start under ulimit -n 256"}
	}
	defer in.stop()
	c0 := treeTicks(in.pids()...)
	rate, fails := b.wrkRate(t, in, 1000, 5*time.Second)
	ticks := treeTicks(in.pids()...) - c0
	// Service afterwards: time to the first good answer.
	start := time.Now()
	recovered := "no answer within 30 s"
	client := &http.Client{Timeout: 2 * time.Second}
	for time.Since(start) < 30*time.Second && b.ctx.Err() == nil {
		resp, err := client.Post(fmt.Sprintf("http://127.0.0.1:%d/sessions/%s/v1/chat/completions", in.port, b.ids[1][0]),
			"application/json", strings.NewReader(chatBody))
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				recovered = fmt.Sprintf("served again after %v", time.Since(start).Round(time.Millisecond))
				break
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	blamed := 0
	for _, line := range strings.Split(in.procs[0].logTail(1<<20), "\n") {
		if strings.Contains(line, "worker unhealthy") || strings.Contains(line, "no live upstreams") {
			blamed++
		}
	}
	return []string{
		fmt.Sprintf("1000 conns for 5 s: %.0f req/s, %d failed, %.2f CPU s", rate, fails, ticksToSeconds(ticks)),
		recovered,
		fmt.Sprintf("%d log lines blaming workers", blamed),
	}
}

func soakReport(rows []soakRow) string {
	if len(rows) == 0 {
		return ""
	}
	var s strings.Builder
	s.WriteString("\n## Soak: overload and faults (make soak)\n\n")
	s.WriteString("Each scenario on a fresh instance (slowloris: Debian's `slowhttptest -H` when installed, else a built-in equivalent); tetherd with `--head-timeout 10s --max-conns 16384`, nginx with `client_header_timeout 10s` and `worker_connections 16384`.\n\n")
	s.WriteString("| scenario | target | figures |\n|---|---|---|\n")
	for _, r := range rows {
		fmt.Fprintf(&s, "| %s | %s | %s |\n", r.scenario, r.target, strings.Join(r.cells, "; "))
	}
	return s.String()
}
