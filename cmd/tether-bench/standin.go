package main

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"
)

// runStandinWorker implements the tether-demo contract well enough to drive
// the harness while cmd/tether-demo does not build ("tether-bench
// standin-worker --listen ADDR --index I"). It is only used as a loud
// fallback, never silently.
func runStandinWorker(args []string) {
	fs := flag.NewFlagSet("standin-worker", flag.ExitOnError)
	listen := fs.String("listen", "127.0.0.1:0", "listen address")
	index := fs.Int("index", 0, "worker index")
	_ = fs.Parse(args)
	prefix := fmt.Sprintf("w%d-", *index)

	checkID := func(w http.ResponseWriter, r *http.Request) bool {
		if id := r.PathValue("id"); !strings.HasPrefix(id, prefix) {
			http.Error(w, "session "+id+" is not on worker "+strconv.Itoa(*index), http.StatusMisdirectedRequest)
			return false
		}
		return true
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok\n") })
	mux.HandleFunc("POST /sessions/{id}/v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		if !checkID(w, r) {
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		body := fmt.Sprintf(`{"id":"chatcmpl-%s","object":"chat.completion","created":%d,"model":"tether-demo","choices":[{"index":0,"message":{"role":"assistant","content":"Hello from worker %d, session ok."},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":8,"total_tokens":20},"system_fingerprint":"tether-demo-standin","worker":%d,"padding":"%s"}`,
			r.PathValue("id"), time.Now().Unix(), *index, *index, strings.Repeat("x", 60))
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		io.WriteString(w, body)
	})
	mux.HandleFunc("POST /sessions/{id}/sha256", func(w http.ResponseWriter, r *http.Request) {
		if !checkID(w, r) {
			return
		}
		h := sha256.New()
		n, err := io.Copy(h, r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"sha256":"%s","bytes":%d}`, hex.EncodeToString(h.Sum(nil)), n)
	})
	mux.HandleFunc("GET /sessions/{id}/blob", func(w http.ResponseWriter, r *http.Request) {
		if !checkID(w, r) {
			return
		}
		size, err := strconv.ParseInt(r.URL.Query().Get("size"), 10, 64)
		if err != nil || size < 0 {
			http.Error(w, "bad size", http.StatusBadRequest)
			return
		}
		seed, _ := strconv.ParseUint(r.URL.Query().Get("seed"), 10, 64)
		chunked, _ := strconv.ParseBool(r.URL.Query().Get("chunked"))
		w.Header().Set("Content-Type", "application/octet-stream")
		if !chunked {
			w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
		}
		buf := make([]byte, 64<<10)
		x := seed*0x9E3779B97F4A7C15 + 1
		for size > 0 {
			for i := 0; i+8 <= len(buf); i += 8 {
				x ^= x << 13
				x ^= x >> 7
				x ^= x << 17
				binary.LittleEndian.PutUint64(buf[i:], x)
			}
			n := int64(len(buf))
			if n > size {
				n = size
			}
			if _, err := w.Write(buf[:n]); err != nil {
				return
			}
			if chunked {
				w.(http.Flusher).Flush() // one 64 KiB chunk per write, as tether-demo does
			}
			size -= n
		}
	})
	srv := &http.Server{Addr: *listen, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	if err := srv.ListenAndServe(); err != nil {
		fmt.Fprintln(os.Stderr, "standin-worker:", err)
		os.Exit(1)
	}
}
