package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

const wrkSample = `Running 5s test @ http://127.0.0.1:8080
  2 threads and 64 connections
  Latency Distribution
     50%    1.02ms
     75%    1.50ms
     90%    2.10ms
     99%    9.27ms
  285714 requests in 5.00s, 120.00MB read
Requests/sec:  57142.80
Transfer/sec:     24.00MB
TETHER_RESULT requests=285714 duration_us=5000000 bytes=125829120 p50_us=1020 p90_us=2100 p99_us=9270 max_us=40000 err_connect=0 err_read=1 err_write=0 err_status=3 err_timeout=2
`

func TestParseWrk(t *testing.T) {
	r, err := parseWrk(wrkSample)
	if err != nil {
		t.Fatal(err)
	}
	if r.requests != 285714 || r.rps != 57142.80 || r.p99 != 9270*time.Microsecond || r.p50 != 1020*time.Microsecond {
		t.Fatalf("got %+v", r)
	}
	if r.errSocket != 3 || r.errStatus != 3 {
		t.Fatalf("errors: %+v", r)
	}
	if _, err := parseWrk("no result"); err == nil {
		t.Fatal("want error without TETHER_RESULT")
	}
}

func TestParseWrkDuration(t *testing.T) {
	for in, want := range map[string]time.Duration{
		"456.00us": 456 * time.Microsecond, "1.23ms": 1230 * time.Microsecond, "1.50s": 1500 * time.Millisecond, "2.00m": 2 * time.Minute,
	} {
		got, err := parseWrkDuration(in)
		if err != nil || got != want {
			t.Errorf("%s: got %v %v want %v", in, got, err, want)
		}
	}
}

func TestParseListeners(t *testing.T) {
	js := `{"pin_dir":"x","listeners":[{"slot":1,"state":"active","active":9,"accepted":10},
	{"slot":0,"state":"active","active":7,"accepted":8},{"slot":5,"state":"empty","active":0,"accepted":3}],"workers":[]}`
	act, acc, _, err := parseListeners([]byte(js))
	if err != nil {
		t.Fatal(err)
	}
	if len(act) != 2 || act[0] != 7 || act[1] != 9 || acc[0] != 8 {
		t.Fatalf("got %v %v", act, acc)
	}
	mm, _ := maxMean(act)
	if mm != 9.0/8.0 {
		t.Fatalf("max/mean %v", mm)
	}
	if _, _, _, err := parseListeners([]byte(`{"listeners":[]}`)); err == nil {
		t.Fatal("want error for no listeners")
	}
}

func TestMedian(t *testing.T) {
	if m := median([]float64{3, 1, 2}); m != 2 {
		t.Fatal(m)
	}
	if m := median([]float64{4, 1, 2, 3}); m != 2.5 {
		t.Fatal(m)
	}
}

func TestReadStatSelf(t *testing.T) {
	st, ok := readStat(os.Getpid())
	if !ok || st.ppid != os.Getppid() {
		t.Fatalf("readStat: %+v %v", st, ok)
	}
	if treeTicks(os.Getpid()) < 0 {
		t.Fatal("negative ticks")
	}
}

// The generated configs must pass the servers' own syntax checks.
func TestConfigsCheck(t *testing.T) {
	dir := t.TempDir()
	workers := []int{30001, 30002, 30003, 30004}
	if bin, err := exec.LookPath("nginx"); err == nil {
		conf, err := nginxConfig(dir, 30000, workers)
		if err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(bin, "-t", "-e", "stderr", "-p", dir+"/", "-c", conf,
			"-g", "pid "+filepath.Join(dir, "nginx.pid")+"; error_log stderr;").CombinedOutput()
		if err != nil {
			t.Errorf("nginx -t: %v\n%s", err, out)
		}
	} else {
		t.Log("nginx not installed: config not checked")
	}
	if bin, err := exec.LookPath("haproxy"); err == nil {
		cfg, err := haproxyConfig(dir, 30000, workers)
		if err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(bin, "-c", "-f", cfg).CombinedOutput()
		if err != nil && !strings.Contains(string(out), "Configuration file is valid") {
			t.Errorf("haproxy -c: %v\n%s", err, out)
		}
	} else {
		t.Log("haproxy not installed: config not checked")
	}
}

// chunkProbe sees each flushed write as one chunk and hashes the body;
// a Content-Length response gives its digest and says it was not chunked.
func TestChunkProbe(t *testing.T) {
	body := make([]byte, 3*65536+100)
	for i := range body {
		body[i] = byte(i * 7)
	}
	sum := sha256.Sum256(body)
	want := hex.EncodeToString(sum[:])
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("chunked") != "1" {
			w.Header().Set("Content-Length", strconv.Itoa(len(body)))
			_, _ = w.Write(body)
			return
		}
		for p := body; len(p) > 0; {
			n := min(len(p), 65536)
			_, _ = w.Write(p[:n])
			w.(http.Flusher).Flush()
			p = p[n:]
		}
	}))
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	got, sizes, err := chunkProbe(context.Background(), addr, "/blob?chunked=1")
	if err != nil || got != want {
		t.Fatalf("chunked: digest %s err %v", got, err)
	}
	if s := fmtChunks(sizes); s != "4 chunks of 100–65536 B (median 65536 B)" {
		t.Errorf("chunks: %s (%v)", s, sizes)
	}
	got, sizes, err = chunkProbe(context.Background(), addr, "/blob")
	if got != want || sizes != nil || err == nil || !strings.Contains(err.Error(), "Content-Length") {
		t.Fatalf("Content-Length: digest %s sizes %v err %v", got, sizes, err)
	}
	if s := fmtChunks([]int{65536, 65536}); s != "2 × 65536 B" {
		t.Errorf("equal chunks: %s", s)
	}
}
