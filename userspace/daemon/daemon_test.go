package daemon

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/demo"
	"github.com/tether-rl/tether/userspace/proxy"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/worker"
)

// startDaemon runs tetherd in-process on loopback, with its counters in
// this process (no BPF maps pinned for the whole machine).
func startDaemon(t *testing.T, opts Options) *Daemon {
	t.Helper()
	opts.BPF = "off"
	return serveDaemon(t, opts)
}

// demoWorkers starts n demo workers for the slots from..from+n-1 (each
// reports its slot as its index, as tetherd --demo starts them:
// cmd/tetherd/demo.go), closed when the test ends; the daemon takes their
// URLs as Options.StartedWorkers.
func demoWorkers(t *testing.T, from, n int) []*demo.Server {
	t.Helper()
	ss := make([]*demo.Server, n)
	for i := range ss {
		ss[i] = startDemo(t, from+i)
	}
	return ss
}

// demoURLs is the URLs of demoWorkers(t, from, n).
func demoURLs(t *testing.T, from, n int) []string {
	t.Helper()
	return urlsOf(demoWorkers(t, from, n))
}

func urlsOf(ss []*demo.Server) []string {
	urls := make([]string, len(ss))
	for i, s := range ss {
		urls[i] = s.URL()
	}
	return urls
}

// serveDaemon runs tetherd in-process on loopback with opts as given and
// shuts it down (checked) when the test ends.
func serveDaemon(t *testing.T, opts Options) *Daemon {
	t.Helper()
	opts.Listen = "127.0.0.1:0"
	if opts.Log == nil {
		opts.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	d, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	d.Serve()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := d.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	})
	return d
}

// newClient is a keep-alive client with its own connections.
func newClient(t *testing.T) *http.Client {
	tr := &http.Transport{MaxIdleConnsPerHost: 4, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}
}

type reply struct {
	status int
	header http.Header
	body   []byte
}

func do(c *http.Client, method, url, body string) (reply, error) {
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, url, rd)
	if err != nil {
		return reply{}, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return reply{resp.StatusCode, resp.Header, b}, err
}

// kaClient is one keep-alive client connection: every request goes on
// it, so a connection the proxy closed shows up as an error.
type kaClient struct {
	c  net.Conn
	br *bufio.Reader
}

func newKAClient(t *testing.T, addr string) *kaClient {
	c, br := dialRaw(t, addr)
	return &kaClient{c, br}
}

func (k *kaClient) post(path, body string) (reply, error) {
	k.c.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := fmt.Fprintf(k.c, "POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", path, len(body), body); err != nil {
		return reply{}, err
	}
	resp, err := http.ReadResponse(k.br, nil)
	if err != nil {
		return reply{}, err
	}
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.Close {
		err = fmt.Errorf("%s: the proxy closed the keep-alive connection", path)
	}
	return reply{resp.StatusCode, resp.Header, b}, err
}

func sessionID(k int) string {
	var b [16]byte
	rand.Read(b[:])
	return "w" + strconv.Itoa(k) + "-" + hex.EncodeToString(b[:])
}

// workerRequests counts the requests that reached the demo workers other
// than health probes (tetherd may probe them): the proxied requests in the
// per-worker counters, plus one for each worker that saw a request that is
// not a probe (demo LastHeaders ignores GET /health and /get_load).
func workerRequests(d *Daemon, demos []*demo.Server) uint64 {
	var n uint64
	for _, w := range d.Table.Snapshot() {
		if w != nil {
			n += w.Stats.Load().Requests
		}
	}
	for _, s := range demos {
		if s.LastHeaders() != nil {
			n++
		}
	}
	return n
}

// 1. Every turn of a session reaches the worker its id names.
func TestAffinity(t *testing.T) {
	const workers, perWorker, turns = 4, 8, 20
	demos := demoWorkers(t, 0, workers)
	d := startDaemon(t, Options{StartedWorkers: urlsOf(demos)})

	type session struct {
		id string
		k  int
	}
	var sessions []session
	for k := 0; k < workers; k++ {
		for i := 0; i < perWorker; i++ {
			sessions = append(sessions, session{sessionID(k), k})
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(sessions))
	for _, s := range sessions {
		c := newKAClient(t, d.Addr())
		wg.Add(1)
		go func() {
			defer wg.Done()
			for turn := 1; turn <= turns; turn++ {
				r, err := c.post("/sessions/"+s.id+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
				if err != nil {
					errs <- err
					return
				}
				var v struct {
					Worker    int    `json:"worker"`
					SessionID string `json:"session_id"`
					Turn      int    `json:"turn"`
				}
				if err := json.Unmarshal(r.body, &v); r.status != 200 || err != nil {
					errs <- fmt.Errorf("%s turn %d: %d %q", s.id, turn, r.status, r.body)
					return
				}
				if v.Worker != s.k || v.SessionID != s.id || v.Turn != turn {
					errs <- fmt.Errorf("%s turn %d: answered by worker %d as %s turn %d", s.id, turn, v.Worker, v.SessionID, v.Turn)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		return
	}
	for _, s := range sessions {
		for j, w := range demos {
			want := 0
			if j == s.k {
				want = turns
			}
			if got := w.Turns(s.id); got != want {
				t.Errorf("worker %d has %d turns of %s, want %d", j, got, s.id, want)
			}
		}
	}
	if got := d.Router.Count(route.ReasonSession); got != uint64(len(sessions)*turns) {
		t.Errorf("session-routed requests %d, want %d", got, len(sessions)*turns)
	}
	// Keep-alive: one client connection per session.
	if got := d.Proxy.Counters().Accepted.Load(); got != uint64(len(sessions)) {
		t.Errorf("proxy accepted %d connections for %d keep-alive clients", got, len(sessions))
	}
}

// 2. Session ids that name no worker: spread or reject.
func TestBadSession(t *testing.T) {
	ids := []string{"x-1", "w9-abc", "w01-abc", "w-1", "w+1-a"}
	for _, mode := range []route.BadSession{route.BadSessionSpread, route.BadSessionReject} {
		t.Run(mode.String(), func(t *testing.T) {
			demos := demoWorkers(t, 0, 4)
			d := startDaemon(t, Options{StartedWorkers: urlsOf(demos), BadSession: mode})
			c := newClient(t)
			before := workerRequests(d, demos)
			for _, id := range ids {
				r, err := do(c, "POST", "http://"+d.Addr()+"/sessions/"+id+"/v1/chat/completions", `{"model":"m"}`)
				if err != nil {
					t.Fatalf("%s: %v", id, err)
				}
				switch mode {
				case route.BadSessionSpread:
					var v struct{ Worker int }
					if r.status != 200 || json.Unmarshal(r.body, &v) != nil || v.Worker < 0 || v.Worker >= 4 {
						t.Fatalf("%s: %d %q", id, r.status, r.body)
					}
					if got := demos[v.Worker].Turns(id); got != 1 {
						t.Fatalf("%s: worker %d has %d turns", id, v.Worker, got)
					}
				case route.BadSessionReject:
					want := `{"error":{"code":404,"message":"unknown session"}}` + "\n"
					if r.status != 404 || string(r.body) != want || r.header.Get("Content-Type") != "application/json" {
						t.Fatalf("%s: %d %q %v", id, r.status, r.body, r.header)
					}
				}
			}
			spread, reject := d.Router.Count(route.ReasonBadSessionSpread), d.Router.Count(route.ReasonBadSessionReject)
			n := uint64(len(ids))
			if mode == route.BadSessionSpread && (spread != n || reject != 0) || mode == route.BadSessionReject && (reject != n || spread != 0) {
				t.Fatalf("reasons: bad_session_spread %d, bad_session_reject %d", spread, reject)
			}
			if got := workerRequests(d, demos) - before; mode == route.BadSessionReject && got != 0 {
				t.Fatalf("rejected requests reached the workers (%d)", got)
			}
		})
	}
}

// 3. Requests without a session spread evenly.
func TestSpread(t *testing.T) {
	const total, clients, workers = 400, 16, 4
	d := startDaemon(t, Options{StartedWorkers: demoURLs(t, 0, workers)})
	var next atomic.Int64
	var mu sync.Mutex
	counts := make([]int, workers)
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for i := 0; i < clients; i++ {
		c := newKAClient(t, d.Addr())
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= total {
				r, err := c.post("/v1/chat/completions", `{"model":"m"}`)
				var v struct{ Worker int }
				if err == nil && (r.status != 200 || json.Unmarshal(r.body, &v) != nil) {
					err = fmt.Errorf("%d %q", r.status, r.body)
				}
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				counts[v.Worker]++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	lo, hi := total, 0
	for _, n := range counts {
		lo, hi = min(lo, n), max(hi, n)
	}
	t.Logf("per-worker requests %v", counts)
	// Keyless requests go to the less loaded of two random workers: the
	// split is random (max/min about 1.3 typically, up to 2 on a loaded
	// machine). A router stuck on one worker, or always starting at worker
	// 0, fails these bounds.
	if lo <= total/10 || 2*hi > 5*lo || 2*counts[0] > 3*total/workers {
		t.Fatalf("per-worker requests %v: want each > %d, max/min <= 2.5 and worker 0 <= 1.5x its share", counts, total/10)
	}
	if got := d.Router.Count(route.ReasonSpread); got != total {
		t.Fatalf("spread reason %d, want %d", got, total)
	}
}

// 4. /health is answered by tetherd itself.
func TestHealthLocal(t *testing.T) {
	demos := demoWorkers(t, 0, 4)
	d := startDaemon(t, Options{StartedWorkers: urlsOf(demos)})
	c := newClient(t)
	before := workerRequests(d, demos)
	var ids []string
	for i := 0; i < 3; i++ {
		r, err := do(c, "GET", "http://"+d.Addr()+"/health", "")
		if err != nil {
			t.Fatal(err)
		}
		var h proxy.HealthBody
		if r.status != 200 || json.Unmarshal(r.body, &h) != nil {
			t.Fatalf("%d %q", r.status, r.body)
		}
		if h.Status != "ok" || h.Workers != 4 || h.HealthyWorkers != 4 || h.InstanceID == "" || h.InstanceID != d.InstanceID {
			t.Fatalf("health %+v (instance %s)", h, d.InstanceID)
		}
		if r.header.Get("X-Tether-Demo-Worker") != "" {
			t.Fatal("health was proxied to a worker")
		}
		ids = append(ids, h.InstanceID)
	}
	if ids[0] != ids[1] || ids[1] != ids[2] {
		t.Fatalf("instance_id changed: %v", ids)
	}
	if got := workerRequests(d, demos) - before; got != 0 {
		t.Fatalf("workers saw %d requests", got)
	}
}

// miles' health contract and the probes: --instance-id is reported as
// session_server_instance_id; /readiness and /liveness are answered by
// tetherd; with no healthy worker /health and /readiness are 503 and
// /liveness stays 200.
func TestHealthProbes(t *testing.T) {
	d := startDaemon(t, Options{StartedWorkers: demoURLs(t, 0, 2), InstanceID: "miles-abc123"})
	c := newClient(t)
	get := func(path string) (int, map[string]any) {
		t.Helper()
		r, err := do(c, "GET", "http://"+d.Addr()+path, "")
		if err != nil {
			t.Fatal(err)
		}
		if r.header.Get("X-Tether-Demo-Worker") != "" {
			t.Fatalf("%s was proxied", path)
		}
		var m map[string]any
		json.Unmarshal(r.body, &m)
		return r.status, m
	}
	if st, m := get("/health"); st != 200 || m["session_server_instance_id"] != "miles-abc123" || m["instance_id"] != "miles-abc123" {
		t.Fatalf("/health: %d %v", st, m)
	}
	if st, m := get("/readiness"); st != 200 || m["status"] != "ready" || m["healthy_workers"] != 2.0 || m["total_workers"] != 2.0 {
		t.Fatalf("/readiness: %d %v", st, m)
	}
	for _, w := range d.Table.Snapshot() {
		w.SetState(worker.Unhealthy)
	}
	if st, m := get("/health"); st != 503 || m["session_server_instance_id"] != "miles-abc123" {
		t.Fatalf("/health with no healthy worker: %d %v", st, m)
	}
	if st, m := get("/readiness"); st != 503 || m["status"] != "not ready" {
		t.Fatalf("/readiness with no healthy worker: %d %v", st, m)
	}
	if st, m := get("/liveness"); st != 200 || m["status"] != "alive" {
		t.Fatalf("/liveness: %d %v", st, m)
	}
}

// dialRaw opens a raw connection with a deadline.
func dialRaw(t *testing.T, addr string) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(20 * time.Second))
	return c, bufio.NewReader(c)
}

func readChunk(br *bufio.Reader) ([]byte, error) {
	line, err := br.ReadString('\n')
	if err != nil {
		return nil, err
	}
	n, err := strconv.ParseInt(strings.TrimSuffix(line, "\r\n"), 16, 64)
	if err != nil {
		return nil, err
	}
	data := make([]byte, n+2)
	if _, err := io.ReadFull(br, data); err != nil {
		return nil, err
	}
	return data[:n], nil
}

// 5. Server-sent events pass through tetherd as the worker writes them.
// The machine may be shared: a schedule missed once is tried again (a
// proxy that buffers misses it every time).
func TestSSETiming(t *testing.T) {
	const chunks, delay = 5, 200 * time.Millisecond
	d := startDaemon(t, Options{StartedWorkers: demoURLs(t, 0, 4)})
	id := sessionID(2)
	once := func() error {
		c, br := dialRaw(t, d.Addr())
		defer c.Close()
		fmt.Fprintf(c, "POST /sessions/%s/slow?chunks=%d&delay_ms=%d HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n", id, chunks, delay.Milliseconds())
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != 200 || resp.Header.Get("X-Tether-Demo-Worker") != "2" || resp.TransferEncoding == nil {
			t.Fatalf("%d %v", resp.StatusCode, resp.Header)
		}
		// Read the chunks ourselves: each one is an event.
		var at []time.Time
		for j := 0; j < chunks; j++ {
			ev, err := readChunk(br)
			if err != nil {
				t.Fatal(err)
			}
			at = append(at, time.Now())
			if !strings.Contains(string(ev), `"seq":`+strconv.Itoa(j)+",") {
				t.Fatalf("event %d: %q", j, ev)
			}
		}
		for j := 1; j < chunks; j++ {
			gap := at[j].Sub(at[j-1])
			if gap < delay-5*time.Millisecond || gap > delay+50*time.Millisecond {
				return fmt.Errorf("event %d came %v after event %d, want %v (+50ms)", j, gap, j-1, delay)
			}
		}
		return nil
	}
	testenv.Timed(t, once)
}

// 6. 16 MiB each way, with Content-Length and chunked, through tetherd
// without the proxy buffering the body.
func TestLargeTransfers(t *testing.T) {
	const size, seed = 16 << 20, 42
	d := startDaemon(t, Options{StartedWorkers: demoURLs(t, 0, 4)})
	h := sha256.New()
	io.Copy(h, demo.Blob(size, seed))
	want := hex.EncodeToString(h.Sum(nil))
	id := sessionID(1)
	buf := make([]byte, 64<<10)
	line := make([]byte, 0, 32)

	upload := func(t *testing.T, chunked bool) {
		c, br := dialRaw(t, d.Addr())
		if chunked {
			fmt.Fprintf(c, "POST /sessions/%s/sha256 HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n", id)
		} else {
			fmt.Fprintf(c, "POST /sessions/%s/sha256 HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n", id, size)
		}
		blob := demo.Blob(size, seed)
		for i := 0; ; i++ {
			// Uneven pieces: chunk boundaries fall anywhere.
			n, err := blob.Read(buf[:len(buf)-i%7*1000])
			if n > 0 && chunked {
				line = strconv.AppendInt(line[:0], int64(n), 16)
				line = append(line, "\r\n"...)
				c.Write(line)
			}
			if n > 0 {
				if _, err := c.Write(buf[:n]); err != nil {
					t.Fatal(err)
				}
			}
			if n > 0 && chunked {
				c.Write(line[len(line)-2:])
			}
			if err == io.EOF {
				break
			}
		}
		if chunked {
			io.WriteString(c, "0\r\n\r\n")
		}
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		var v struct {
			Sha256 string
			Bytes  int64
		}
		if resp.StatusCode != 200 || json.Unmarshal(body, &v) != nil || v.Sha256 != want || v.Bytes != size {
			t.Fatalf("%d %q, want sha256 %s", resp.StatusCode, body, want)
		}
	}
	download := func(t *testing.T, chunked bool) {
		c, br := dialRaw(t, d.Addr())
		fmt.Fprintf(c, "GET /sessions/%s/blob?size=%d&seed=%d&chunked=%v HTTP/1.1\r\nHost: t\r\n\r\n", id, size, seed, map[bool]int{false: 0, true: 1}[chunked])
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != 200 || chunked != (len(resp.TransferEncoding) > 0) || !chunked && resp.ContentLength != size {
			t.Fatalf("%d %v", resp.StatusCode, resp.Header)
		}
		h := sha256.New()
		n, err := io.CopyBuffer(h, struct{ io.Reader }{resp.Body}, buf)
		if err != nil || n != size {
			t.Fatalf("read %d bytes: %v", n, err)
		}
		if got := hex.EncodeToString(h.Sum(nil)); got != want {
			t.Fatalf("sha256 %s, want %s", got, want)
		}
	}
	cases := []struct {
		name    string
		fn      func(*testing.T, bool)
		chunked bool
	}{
		{"upload content-length", upload, false},
		{"upload chunked", upload, true},
		{"download content-length", download, false},
		{"download chunked", download, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.fn(t, tc.chunked) // warm up: pools, buffers, connections
			var m0, m1 runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&m0)
			tc.fn(t, tc.chunked)
			runtime.ReadMemStats(&m1)
			// HeapAlloc may fall when a collection runs during the transfer;
			// TotalAlloc only grows: a buffered body shows in both.
			grew := int64(m1.HeapAlloc) - int64(m0.HeapAlloc)
			alloc := m1.TotalAlloc - m0.TotalAlloc
			t.Logf("heap %+d bytes, allocated %d bytes for %d bytes moved", grew, alloc, size)
			if grew >= 4<<20 || alloc >= 4<<20 {
				t.Fatalf("heap grew %d bytes, %d allocated: the body was buffered", grew, alloc)
			}
		})
	}
}

// 13 (through tetherd). --response-timeout against a worker that never
// answers: 504 with the fixed body.
func TestResponseTimeout(t *testing.T) {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				c.SetDeadline(time.Now().Add(5 * time.Second))
				io.Copy(io.Discard, c) // reads, never answers
			}()
		}
	}()
	d := startDaemon(t, Options{Workers: []string{"http://" + ln.Addr().String()}, Proxy: proxy.Config{ResponseTimeout: 200 * time.Millisecond}})
	c := newClient(t)
	start := time.Now()
	r, err := do(c, "GET", "http://"+d.Addr()+"/sessions/w0-abc/v1/models", "")
	if err != nil {
		t.Fatal(err)
	}
	want := `{"error":{"code":504,"message":"gateway timeout: the worker did not answer in time"}}` + "\n"
	if r.status != 504 || string(r.body) != want {
		t.Fatalf("%d %q", r.status, r.body)
	}
	if el := time.Since(start); el < 190*time.Millisecond || el > 2*time.Second {
		t.Fatalf("504 after %v", el)
	}
}

// The body bytes peeked for routing (request id, --keyless=prefix) come
// before the chunk framing is validated: a chunk size that overflows a
// signed integer is a 400 like any bad framing, and tetherd goes on
// serving.
func TestHostileChunkSizeBeforeRouting(t *testing.T) {
	for _, keyless := range []route.KeylessMode{route.KeylessLeast, route.KeylessPrefix} {
		t.Run(keyless.String(), func(t *testing.T) {
			d := startDaemon(t, Options{StartedWorkers: demoURLs(t, 0, 2), Routing: RoutingOptions{Keyless: keyless}})
			for _, size := range []string{"8000000000000000", "ffffffffffffffff", "fffffffffffffffff"} {
				c, br := dialRaw(t, d.Addr())
				io.WriteString(c, "POST /generate HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"+size+"\r\n{\"rid\":\"x\",\"text\":\"hi\"}")
				resp, err := http.ReadResponse(br, nil)
				if err != nil || resp.StatusCode != 400 {
					t.Fatalf("chunk size %s: %v %v, want 400", size, resp, err)
				}
				c.Close()
			}
			r, err := do(newClient(t), "GET", "http://"+d.Addr()+"/health", "")
			if err != nil || r.status != 200 {
				t.Fatalf("health after hostile chunk sizes: %v %v", r.status, err)
			}
		})
	}
}

// A small chunked body sent in the same write as its head is answered at
// once: the routing peek once waited for more body bytes (up to the I/O
// timeout) before routing.
func TestChunkedBodyWithHead(t *testing.T) {
	d := startDaemon(t, Options{StartedWorkers: demoURLs(t, 0, 2)})
	for _, path := range []string{"/sessions", "/generate"} {
		c, br := dialRaw(t, d.Addr())
		c.SetDeadline(time.Now().Add(5 * time.Second))
		io.WriteString(c, "POST "+path+" HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"+
			"b\r\n{\"rid\":\"q\"}\r\n0\r\n\r\n")
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		io.Copy(io.Discard, resp.Body)
		if resp.StatusCode >= 500 {
			t.Fatalf("%s: %d", path, resp.StatusCode)
		}
	}
}
