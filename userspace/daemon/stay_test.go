package daemon

import (
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/health"
	"github.com/tether-rl/tether/userspace/proxy"
	"github.com/tether-rl/tether/userspace/route"
)

// engines starts n loopback "engines" that hold every request for hold
// (respecting the client leaving) and answer with their index in
// X-Engine; it returns their URLs.
func engines(t *testing.T, n int, hold time.Duration) []string {
	t.Helper()
	var urls []string
	for i := 0; i < n; i++ {
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		idx := strconv.Itoa(i)
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if hold > 0 && r.URL.Path != "/health" {
				select {
				case <-time.After(hold):
				case <-r.Context().Done():
					return
				}
			}
			w.Header().Set("X-Engine", idx)
			w.Write([]byte(`{"ok":true}`))
		})}
		go srv.Serve(ln)
		t.Cleanup(func() { srv.Close() })
		urls = append(urls, "http://"+ln.Addr().String())
	}
	return urls
}

// keyClient sends keyed requests through tetherd and says which engine
// answered.
type keyClient struct {
	t    *testing.T
	addr string
	c    *http.Client
}

func newKeyClient(t *testing.T, addr string, conns int) *keyClient {
	tr := &http.Transport{Proxy: nil, MaxIdleConnsPerHost: conns, MaxConnsPerHost: conns}
	t.Cleanup(tr.CloseIdleConnections)
	return &keyClient{t: t, addr: addr, c: &http.Client{Transport: tr, Timeout: 30 * time.Second}}
}

func (k *keyClient) engine(key string) (string, error) {
	req, _ := http.NewRequest("POST", "http://"+k.addr+"/generate", nil)
	req.Header.Set("X-Session-ID", key)
	resp, err := k.c.Do(req)
	if err != nil {
		return "", err
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		return "", fmt.Errorf("status %d", resp.StatusCode)
	}
	return resp.Header.Get("X-Engine"), nil
}

// Under the default hash policy, every turn of a session stays on one
// engine while no engine is overloaded: clients with one key each, 5
// sequential turns per key, all clients at once (three shapes: 256
// clients on engines that hold each request 200 ms, 16 clients, instant
// engines). Also SkyRL's num_samples: concurrent requests of one key all
// reach one engine.
func TestKeysStayPutUnderLoad(t *testing.T) {
	for _, tc := range []struct {
		clients int
		hold    time.Duration
	}{{256, 200 * time.Millisecond}, {16, 200 * time.Millisecond}, {16, 0}, {256, 0}} {
		t.Run(fmt.Sprintf("%d clients, hold %v", tc.clients, tc.hold), func(t *testing.T) {
			const n, turns = 8, 5
			d := startDaemon(t, Options{Workers: engines(t, n, tc.hold)})
			kc := newKeyClient(t, d.Addr(), tc.clients)
			var wg sync.WaitGroup
			errs := make(chan error, tc.clients)
			stayed := make([]bool, tc.clients)
			for c := 0; c < tc.clients; c++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					key := fmt.Sprintf("traj-%d-%d", tc.clients, c)
					first := ""
					stayed[c] = true
					for turn := 0; turn < turns; turn++ {
						e, err := kc.engine(key)
						if err != nil {
							errs <- fmt.Errorf("key %s turn %d: %w", key, turn, err)
							return
						}
						if turn == 0 {
							first = e
						} else if e != first {
							stayed[c] = false
						}
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}
			kept := 0
			for _, s := range stayed {
				if s {
					kept++
				}
			}
			t.Logf("%d of %d keys kept one engine for %d turns; decisions: %v", kept, tc.clients, turns, decisions(d))
			if kept != tc.clients {
				t.Errorf("%d of %d keys changed engine", tc.clients-kept, tc.clients)
			}
		})
	}
	t.Run("num_samples", func(t *testing.T) {
		d := startDaemon(t, Options{Workers: engines(t, 8, 200*time.Millisecond)})
		for _, samples := range []int{4, 16} {
			kc := newKeyClient(t, d.Addr(), samples)
			seen := make(chan string, samples)
			var wg sync.WaitGroup
			for i := 0; i < samples; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					e, err := kc.engine(fmt.Sprint("group-", samples))
					if err != nil {
						t.Error(err)
					}
					seen <- e
				}()
			}
			wg.Wait()
			close(seen)
			set := map[string]bool{}
			for e := range seen {
				set[e] = true
			}
			if len(set) != 1 {
				t.Errorf("%d concurrent samples of one key on %d engines: %v", samples, len(set), set)
			}
		}
	})
}

// decisions returns the nonzero routing decision counts.
func decisions(d *Daemon) map[string]uint64 {
	out := map[string]uint64{}
	for k, v := range d.RoutingCounts().Decisions {
		if v > 0 {
			out[k] = v
		}
	}
	return out
}

// Adding one worker to N through the admin API moves about 1/(N+1) of the
// keys, only to the new worker; removing it brings every key back.
func TestAddRemoveWorkerMovesFewKeys(t *testing.T) {
	const n, keys = 4, 400
	urls := engines(t, n+1, 0)
	d := ctlDaemon(t, Options{Workers: urls[:n]})
	kc := newKeyClient(t, d.Addr(), 8)
	owners := func() []string {
		t.Helper()
		out := make([]string, keys)
		var wg sync.WaitGroup
		sem := make(chan struct{}, 8)
		for k := 0; k < keys; k++ {
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				e, err := kc.engine(fmt.Sprint("key-", k))
				if err != nil {
					t.Error(err)
				}
				out[k] = e
			}()
		}
		wg.Wait()
		return out
	}
	before := owners()
	if again := owners(); fmt.Sprint(again) != fmt.Sprint(before) {
		t.Fatal("keys moved between two rounds with no change")
	}
	admin := "http://" + d.AdminAddr()
	if r := ctlDo(t, "POST", admin+"/add_worker?url="+url.QueryEscape(urls[n]), ""); r.status != 200 {
		t.Fatalf("add_worker: %d %s", r.status, r.body)
	}
	after := owners()
	moved := 0
	for k := range after {
		if after[k] != before[k] {
			moved++
			if after[k] != strconv.Itoa(n) {
				t.Errorf("key-%d moved from engine %s to %s, not to the new one", k, before[k], after[k])
			}
		}
	}
	frac := float64(moved) / keys
	t.Logf("adding a 5th worker moved %d of %d keys (%.1f%%, ideal %.1f%%)", moved, keys, 100*frac, 100.0/(n+1))
	if frac < 0.5/(n+1) || frac > 1.6/(n+1) {
		t.Errorf("moved %.1f%% of the keys, want about %.1f%%", 100*frac, 100.0/(n+1))
	}
	if again := owners(); fmt.Sprint(again) != fmt.Sprint(after) {
		t.Error("keys flapped in the round after the add")
	}
	if r := ctlDo(t, "POST", admin+"/remove_worker?url="+url.QueryEscape(urls[n]), ""); r.status != 200 {
		t.Fatalf("remove_worker: %d %s", r.status, r.body)
	}
	back := owners()
	lost := 0
	for k := range back {
		if back[k] != before[k] {
			lost++
		}
	}
	t.Logf("after removing it: %d of %d keys not on their first engine", lost, keys)
	if lost != 0 {
		t.Errorf("%d keys did not come back", lost)
	}
}

// A keyed request whose engine refuses the connection (it died; the
// health checks have not noticed yet) goes to the key's ring successor:
// nothing was sent, so no 502. Pinned requests (a w<idx>- session) get a
// 502 that says nothing was sent.
func TestRefusedConnectRerouted(t *testing.T) {
	var srvs []*http.Server
	var urls []string
	for i := 0; i < 4; i++ {
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		idx := strconv.Itoa(i)
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("X-Engine", idx)
		})}
		go srv.Serve(ln)
		t.Cleanup(func() { srv.Close() })
		srvs = append(srvs, srv)
		urls = append(urls, "http://"+ln.Addr().String())
	}
	d := startDaemon(t, Options{Workers: urls, Health: health.Config{Interval: time.Hour}})
	kc := newKeyClient(t, d.Addr(), 8)
	owner := map[string]string{}
	for k := 0; k < 100; k++ {
		key := fmt.Sprint("traj-", k)
		e, err := kc.engine(key)
		if err != nil {
			t.Fatal(err)
		}
		owner[key] = e
	}
	srvs[2].Close() // engine 2 dies: its port refuses connections
	moved := 0
	for key, was := range owner {
		e, err := kc.engine(key)
		if err != nil {
			t.Fatalf("key %s (engine %s): %v", key, was, err)
		}
		if was == "2" {
			moved++
			if e == "2" {
				t.Fatalf("key %s still on the dead engine", key)
			}
		} else if e != was {
			t.Errorf("key %s moved from live engine %s to %s", key, was, e)
		}
	}
	if moved == 0 {
		t.Fatal("no key owned by engine 2")
	}
	// (Once passive health checks mark the engine down, its keys fail
	// over without a refused connect: at least the first one rerouted.)
	if got := d.Router.Count(route.ReasonReroute); got == 0 {
		t.Errorf("no reroute for %d requests to the dead engine", moved)
	}
	resp, err := kc.c.Post("http://"+d.Addr()+"/sessions/w2-abc/x", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 502 || resp.Header.Get(proxy.UpstreamStateHeader) != "not-sent" {
		t.Fatalf("pinned session on the dead engine: %d %q", resp.StatusCode, resp.Header.Get(proxy.UpstreamStateHeader))
	}
	t.Logf("%d keys of the dead engine answered by their ring successors, 0 errors", moved)
}
