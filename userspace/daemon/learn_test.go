package daemon

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/supervisor"
)

// bareSessionServers starts n session servers that know nothing of tether:
// POST /sessions mints a plain uuid, and a turn or DELETE of an id the
// server did not mint is a 404 (as a real session server answers).
// Answers carry X-Engine: <index>.
func bareSessionServers(t *testing.T, n int) []string {
	t.Helper()
	var urls []string
	for i := 0; i < n; i++ {
		var mu sync.Mutex
		ids := map[string]int{}
		idx := strconv.Itoa(i)
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("X-Engine", idx)
			w.Header().Set("Content-Type", "application/json")
			if r.URL.Path == "/health" {
				io.WriteString(w, `{"status":"ok"}`)
				return
			}
			if r.Method == "POST" && r.URL.Path == "/sessions" {
				var b [16]byte
				rand.Read(b[:])
				b[6], b[8] = b[6]&0x0f|0x40, b[8]&0x3f|0x80
				id := fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
				mu.Lock()
				ids[id] = 0
				mu.Unlock()
				w.WriteHeader(201)
				json.NewEncoder(w).Encode(map[string]any{"session_id": id, "created": time.Now().Unix()})
				return
			}
			var id, rest string
			if _, err := fmt.Sscanf(r.URL.Path, "/sessions/%s", &rest); err == nil {
				id = rest
				for j := range rest {
					if rest[j] == '/' {
						id = rest[:j]
						break
					}
				}
			}
			mu.Lock()
			turns, ok := ids[id]
			if ok {
				if r.Method == "DELETE" {
					delete(ids, id)
				} else {
					ids[id] = turns + 1
				}
			}
			mu.Unlock()
			if !ok {
				w.WriteHeader(404)
				io.WriteString(w, `{"error":"unknown session"}`)
				return
			}
			fmt.Fprintf(w, `{"session_id":%q,"turns":%d}`, id, turns+1)
		})
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: h}
		go srv.Serve(ln)
		t.Cleanup(func() { srv.Close() })
		urls = append(urls, "http://"+ln.Addr().String())
	}
	return urls
}

// trajectories runs m concurrent multi-turn trajectories through tetherd
// at addr: create a session, then turns; it returns each session's id and
// creator, and fails the test if a turn reached another engine.
func trajectories(t *testing.T, addr string, m, turns int) map[string]string {
	return trajectoriesBy(t, addr, m, turns, "X-Engine")
}

// trajectoriesBy is trajectories with the engine named by header hdr.
func trajectoriesBy(t *testing.T, addr string, m, turns int, hdr string) map[string]string {
	t.Helper()
	kc := newKeyClient(t, addr, m)
	var mu sync.Mutex
	out := map[string]string{}
	var wg sync.WaitGroup
	for i := 0; i < m; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := kc.c.Post("http://"+addr+"/sessions", "application/json", nil)
			if err != nil {
				t.Error(err)
				return
			}
			var s struct {
				SessionID string `json:"session_id"`
			}
			json.NewDecoder(resp.Body).Decode(&s)
			resp.Body.Close()
			creator := resp.Header.Get(hdr)
			if resp.StatusCode != 201 || s.SessionID == "" {
				t.Errorf("create: %d %+v", resp.StatusCode, s)
				return
			}
			for turn := 0; turn < turns; turn++ {
				if st, e := sessionTurnBy(kc, addr, s.SessionID, hdr); st != 200 || e != creator {
					t.Errorf("session %s (engine %s) turn %d: %d from engine %q", s.SessionID, creator, turn, st, e)
					return
				}
			}
			mu.Lock()
			out[s.SessionID] = creator
			mu.Unlock()
		}()
	}
	wg.Wait()
	return out
}

func sessionTurn(kc *keyClient, addr, id string) (int, string) {
	return sessionTurnBy(kc, addr, id, "X-Engine")
}

func sessionTurnBy(kc *keyClient, addr, id, hdr string) (int, string) {
	resp, err := kc.c.Post("http://"+addr+"/sessions/"+id+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"messages":[{"role":"user","content":"next turn"}]}`))
	if err != nil {
		return 0, err.Error()
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, resp.Header.Get(hdr)
}

// Learned affinity with --spawn: 4 tether-demo --bare-ids processes (uuid
// ids, strict about them), 64 concurrent trajectories of 5 turns, every
// turn on the worker that created its session.
func TestLearnedSessionsSpawned(t *testing.T) {
	if testing.Short() {
		t.Skip("builds tether-demo")
	}
	bin := buildDemo(t)
	opts := Options{Spawn: supervisor.Config{N: 4, Command: []string{bin, "--listen", "127.0.0.1:{port}", "--index", "{index}", "--bare-ids"}, Grace: 5 * time.Second},
		SpawnOutput: io.Discard, Registry: registry.Config{StartupTimeout: 20 * time.Second}, BadSession: route.BadSessionReject}
	opts.BPF = "off"
	opts.Health.Interval = 100 * time.Millisecond
	d := serveDaemon(t, opts)
	deadline := time.Now().Add(30 * time.Second)
	for d.Registry.Counts()["healthy"] < 4 {
		if time.Now().After(deadline) {
			t.Fatalf("spawned workers not up: %+v", d.Registry.List())
		}
		time.Sleep(20 * time.Millisecond)
	}
	sessions := trajectoriesBy(t, d.Addr(), 64, 5, "X-Tether-Demo-Worker")
	per := map[string]int{}
	for _, w := range sessions {
		per[w]++
	}
	c := d.RoutingCounts()
	t.Logf("64 trajectories over workers %v; decisions %v; learned %+v", per, decisions(d), c.Learned)
	if len(sessions) != 64 || c.Decisions["learned"] != 64*5 || c.Learned.Learned != 64 {
		t.Errorf("%d sessions, %d learned turns, %+v", len(sessions), c.Decisions["learned"], c.Learned)
	}
	if len(per) < 3 {
		t.Errorf("64 sessions created on %d workers only", len(per))
	}
}

// Learned affinity: 64 concurrent trajectories against unmodified
// uuid-minting session servers, every turn on its creator; with the BPF
// store the learned ids still route after tetherd restarts (with the
// engines given in another order); with --sticky-store=memory they do not.
func TestLearnedSessionsAcrossRestart(t *testing.T) {
	pins := testenv.BPFFS(t)
	urls := bareSessionServers(t, 4)
	rev := []string{urls[3], urls[2], urls[1], urls[0]}
	start := func(workers []string, store StickyStore) *Daemon {
		t.Helper()
		d, err := New(Options{Listen: "127.0.0.1:0", Workers: workers, BPF: "required", PinDir: pins, BadSession: route.BadSessionReject,
			Routing: RoutingOptions{StickyStore: store}, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			t.Fatal(err)
		}
		d.Serve()
		return d
	}
	stop := func(d *Daemon) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := d.Shutdown(ctx); err != nil {
			t.Fatal(err)
		}
	}

	d := start(urls, "auto")
	sessions := trajectories(t, d.Addr(), 64, 5)
	if c := d.RoutingCounts(); c.Learned == nil || c.Learned.Learned != 64 || !c.StickyShared {
		t.Fatalf("after 64 creates: %+v", c)
	}
	t.Logf("64 trajectories x 5 turns: decisions %v", decisions(d))
	stop(d)

	// Restarted, workers in reverse order (other slots): the pinned map
	// still names each session's engine.
	d = start(rev, "auto")
	kc := newKeyClient(t, d.Addr(), 8)
	for id, creator := range sessions {
		if st, e := sessionTurn(kc, d.Addr(), id); st != 200 || e != creator {
			t.Fatalf("after restart, session %s (engine %s): %d from %q", id, creator, st, e)
		}
	}
	// DELETE forgets: the next turn is a bad session (404, rejected by
	// tetherd before any engine sees it).
	for id := range sessions {
		req, _ := http.NewRequest("DELETE", "http://"+d.Addr()+"/sessions/"+id, nil)
		resp, err := kc.c.Do(req)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("delete %s: %v %v", id, err, resp)
		}
		resp.Body.Close()
		if st, e := sessionTurn(kc, d.Addr(), id); st != 404 || e != "" {
			t.Fatalf("turn after delete: %d from %q", st, e)
		}
		break
	}
	stop(d)

	// --sticky-store=memory: learned ids do not survive a restart.
	d = start(urls, "memory")
	sessions = trajectories(t, d.Addr(), 16, 2)
	stop(d)
	d = start(urls, "memory")
	defer stop(d)
	kc = newKeyClient(t, d.Addr(), 8)
	for id := range sessions {
		if st, e := sessionTurn(kc, d.Addr(), id); st != 404 || e != "" {
			t.Fatalf("memory store after restart: %d from %q, want tetherd's 404", st, e)
		}
	}
}
