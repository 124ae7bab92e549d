package pd_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/fakepd"
	"github.com/tether-rl/tether/userspace/pd"
)

// call is a client request in flight.
type call struct {
	done   atomic.Bool
	status int
	body   []byte
	err    error
	first  chan struct{} // closed at the first body bytes
}

// start posts from a goroutine; the answer is read whole.
func (r *router) start(ctx context.Context, path, b string) *call {
	c := &call{first: make(chan struct{})}
	go func() {
		defer c.done.Store(true)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.http.URL+path, strings.NewReader(b))
		req.Header.Set("Content-Type", "application/json")
		resp, err := r.http.Client().Do(req)
		if err != nil {
			c.err = err
			close(c.first)
			return
		}
		defer resp.Body.Close()
		c.status = resp.StatusCode
		br := bufio.NewReader(resp.Body)
		if _, err := br.Peek(1); err != nil {
			c.err = err
			close(c.first)
			return
		}
		close(c.first)
		c.body, c.err = io.ReadAll(br)
	}()
	return c
}

// faultFleet: two pairs; pair 0's engines slow where a fault needs it, the
// second pair as it comes (the retry's).
func faultFleet(t *testing.T, proto pd.Protocol, notify bool, p0, d0 fakepd.Options) (*fleet, *router) {
	t.Helper()
	base := fakepd.Options{Notify: notify, WaitTimeout: 30 * time.Second, Lease: 30 * time.Second}
	p0.Notify, d0.Notify = notify, notify
	if p0.WaitTimeout == 0 {
		p0.WaitTimeout = base.WaitTimeout
	}
	if d0.WaitTimeout == 0 {
		d0.WaitTimeout = base.WaitTimeout
	}
	if p0.Lease == 0 {
		p0.Lease = base.Lease
	}
	f := newFleetOpts(t, proto, []fakepd.Options{p0, base}, []fakepd.Options{d0, base})
	r := newRouter(t, f, pd.Config{})
	r.ch.fixed = []pd.Pair{r.ch.pair(0, 0), r.ch.pair(1, 1)}
	return f, r
}

func modes() []struct {
	proto  pd.Protocol
	notify bool
} {
	var out []struct {
		proto  pd.Protocol
		notify bool
	}
	for _, p := range protocols {
		for _, n := range []bool{false, true} {
			out = append(out, struct {
				proto  pd.Protocol
				notify bool
			}{p, n})
		}
	}
	return out
}

func name(p pd.Protocol, notify bool) string { return fmt.Sprintf("%v/notify=%v", p, notify) }

// TestPrefillKilledMidRequest: the prefill dies while it computes; its
// decode (SGLang: waiting for the room) is cancelled within 1 s, and the
// client has the retry's answer within 2 s, with notification between the
// sides or without.
func TestPrefillKilledMidRequest(t *testing.T) {
	for _, m := range modes() {
		t.Run(name(m.proto, m.notify), func(t *testing.T) {
			f, r := faultFleet(t, m.proto, m.notify, fakepd.Options{PrefillDelay: time.Hour}, fakepd.Options{})
			path := "/v1/completions"
			c := r.start(context.Background(), path, body(path, "a long prompt to prefill", 6, true, ""))
			testenv.WaitFor(t, "the prefill to hold the request", func() bool {
				if m.proto == pd.SGLang {
					return f.prefills[0].Held() == 1 && f.decodes[0].Held() == 1
				}
				return statsOf(f.prefills[0]).Requests.Load() == 1
			})
			f.prefills[0].Kill()
			testenv.WaitForWithin(t, "the decode leg to be cancelled", time.Second, func() bool { return f.decodes[0].Held() == 0 })
			testenv.WaitForWithin(t, "the client's answer", 2*time.Second, c.done.Load)
			if c.err != nil || c.status != 200 || textOf(t, path, c.body) != expected("a long prompt to prefill", 6) {
				t.Fatalf("answer %d %v %s", c.status, c.err, c.body)
			}
			testenv.WaitFor(t, "the fleet to hold nothing", func() bool { return f.held() == 0 })
			r.settled(t)
			if v := r.srv.Counters.Values(); v.PrefillFailed != 1 || v.Retries != 1 || v.Served != 1 {
				t.Errorf("counters %+v", v)
			}
			if m.proto == pd.VLLM && statsOf(f.decodes[0]).Requests.Load() != 0 {
				t.Error("vLLM: the decode was sent a request before the prefill answered")
			}
		})
	}
}

// TestDecodeKilledMidStream: the decode dies after the client had events:
// the stream ends with a valid JSON error event within 2 s, and the
// prefill holds nothing within 1 s.
func TestDecodeKilledMidStream(t *testing.T) {
	for _, m := range modes() {
		t.Run(name(m.proto, m.notify), func(t *testing.T) {
			f, r := faultFleet(t, m.proto, m.notify, fakepd.Options{}, fakepd.Options{TokenDelay: 10 * time.Millisecond})
			path := "/v1/chat/completions"
			c := r.start(context.Background(), path, body(path, "hi", 2000, true, ""))
			<-c.first
			f.decodes[0].Kill()
			testenv.WaitForWithin(t, "the prefill to hold nothing", time.Second, func() bool { return f.prefills[0].Held() == 0 })
			testenv.WaitForWithin(t, "the client's answer to end", 2*time.Second, c.done.Load)
			if c.status != 200 || c.err != nil {
				t.Fatalf("answer %d %v", c.status, c.err)
			}
			events := strings.Split(strings.TrimSpace(string(c.body)), "\n\n")
			last, ok := strings.CutPrefix(events[len(events)-1], "data: ")
			var ev struct {
				Error struct {
					Message string `json:"message"`
					Code    int    `json:"code"`
				} `json:"error"`
			}
			if !ok || json.Unmarshal([]byte(last), &ev) != nil || ev.Error.Code != 502 || ev.Error.Message == "" {
				t.Fatalf("the stream does not end with a JSON error event: %q", last)
			}
			testenv.WaitFor(t, "the fleet to hold nothing", func() bool { return f.held() == 0 })
			r.settled(t)
			if v := r.srv.Counters.Values(); v.MidStream != 1 || v.Retries != 0 {
				t.Errorf("counters %+v", v)
			}
		})
	}
}

// TestPrefillRefuses: the prefill's 400 goes to the client as it is; the
// decode leg is cancelled within 1 s; no retry.
func TestPrefillRefuses(t *testing.T) {
	for _, m := range modes() {
		t.Run(name(m.proto, m.notify), func(t *testing.T) {
			f, r := faultFleet(t, m.proto, m.notify, fakepd.Options{}, fakepd.Options{})
			f.prefills[0].FailNext(400, 1)
			path := "/v1/completions"
			c := r.start(context.Background(), path, body(path, "refused", 4, false, ""))
			testenv.WaitForWithin(t, "the client's answer", 2*time.Second, c.done.Load)
			if c.status != 400 || !strings.Contains(string(c.body), "injected fault") {
				t.Fatalf("answer %d %s", c.status, c.body)
			}
			testenv.WaitForWithin(t, "the decode leg to be cancelled", time.Second, func() bool { return f.decodes[0].Held() == 0 })
			testenv.WaitFor(t, "the fleet to hold nothing", func() bool { return f.held() == 0 })
			r.settled(t)
			if v := r.srv.Counters.Values(); v.PrefillRefused != 1 || v.Retries != 0 {
				t.Errorf("counters %+v", v)
			}
		})
	}
}

// TestDecodeFails: the decode answers 500 before any byte: the prefill's
// room or blocks are let go (SGLang within 1 s by the router's abort; vLLM
// within 1 s with notification, at the lease's end without) and the client
// has the retry's answer within 2 s.
func TestDecodeFails(t *testing.T) {
	for _, m := range modes() {
		t.Run(name(m.proto, m.notify), func(t *testing.T) {
			p0 := fakepd.Options{}
			if m.proto == pd.VLLM && !m.notify {
				p0.Lease = 300 * time.Millisecond
			}
			f, r := faultFleet(t, m.proto, m.notify, p0, fakepd.Options{})
			f.decodes[0].FailNext(500, 1)
			path := "/generate"
			if m.proto == pd.VLLM {
				path = "/v1/completions"
			}
			c := r.start(context.Background(), path, body(path, "decode fails", 5, false, ""))
			testenv.WaitForWithin(t, "the client's answer", 2*time.Second, c.done.Load)
			if c.status != 200 || textOf(t, path, c.body) != expected("decode fails", 5) {
				t.Fatalf("answer %d %v %s", c.status, c.err, c.body)
			}
			if m.proto == pd.VLLM && !m.notify {
				testenv.WaitFor(t, "the lease to free the blocks", func() bool { return f.prefills[0].Held() == 0 })
				if statsOf(f.prefills[0]).LeaseExpiry.Load() != 1 {
					t.Error("the blocks were not freed by the lease")
				}
			} else {
				testenv.WaitForWithin(t, "the prefill to let go", time.Second, func() bool { return f.prefills[0].Held() == 0 })
			}
			testenv.WaitFor(t, "the fleet to hold nothing", func() bool { return f.held() == 0 })
			r.settled(t)
			if v := r.srv.Counters.Values(); v.DecodeFailed != 1 || v.Retries != 1 || v.Served != 1 {
				t.Errorf("counters %+v", v)
			}
		})
	}
}

// TestBothAttemptsFail: the second attempt's 5xx goes to the client as it is.
func TestBothAttemptsFail(t *testing.T) {
	for _, proto := range protocols {
		t.Run(proto.String(), func(t *testing.T) {
			f, r := faultFleet(t, proto, true, fakepd.Options{}, fakepd.Options{})
			f.decodes[0].FailNext(500, 1)
			f.decodes[1].FailNext(503, 1)
			c := r.start(context.Background(), "/v1/completions", body("/v1/completions", "x", 2, true, ""))
			testenv.WaitForWithin(t, "the client's answer", 2*time.Second, c.done.Load)
			if c.status != 503 {
				t.Fatalf("answer %d %s", c.status, c.body)
			}
			testenv.WaitFor(t, "the fleet to hold nothing", func() bool { return f.held() == 0 })
			r.settled(t)
			if v := r.srv.Counters.Values(); v.GaveUp != 1 || v.Retries != 1 {
				t.Errorf("counters %+v", v)
			}
		})
	}
}

// TestPausedAttemptsNotCharged: attempts that fail while a pause began
// (a weight sync's abort, pd.PauseCounter) are tried again on the same
// pair and released as not failed, however many pauses the request meets
// up to pd's bound; an attempt that fails with no pause is charged as
// before (one more, then the client has the engine's answer).
func TestPausedAttemptsNotCharged(t *testing.T) {
	for _, proto := range protocols {
		t.Run(proto.String(), func(t *testing.T) {
			for _, tc := range []struct {
				name            string
				pauses, fails   int
				status          int
				retries, paused uint64
				released        []bool
			}{
				// Three attempts aborted by three pauses, the fourth answers.
				{"three-pauses", 3, 3, 200, 3, 3, []bool{false, false, false, false}},
				// Two aborted by pauses, one failed by its pair, then the
				// answer: the pair's failure still has its one retry.
				{"pauses-then-a-failure", 2, 3, 200, 3, 2, []bool{false, false, true, false}},
				// Pauses on every attempt: the bound's last attempt answers
				// the client with the engine's 500.
				{"bounded", 100, 100, 500, 5, 5, []bool{false, false, false, false, false, false}},
			} {
				t.Run(tc.name, func(t *testing.T) {
					f, r := faultFleet(t, proto, true, fakepd.Options{}, fakepd.Options{})
					r.ch.fixed = nil
					for range 8 {
						r.ch.fixed = append(r.ch.fixed, r.ch.pair(0, 0))
					}
					r.ch.pauses = tc.pauses
					f.decodes[0].FailNext(500, tc.fails)
					c := r.start(context.Background(), "/v1/completions", body("/v1/completions", "paused", 3, false, ""))
					testenv.WaitForWithin(t, "the client's answer", 10*time.Second, c.done.Load)
					if c.status != tc.status {
						t.Fatalf("answer %d %s", c.status, c.body)
					}
					if tc.status == 200 && textOf(t, "/v1/completions", c.body) != expected("paused", 3) {
						t.Fatalf("answer %s", c.body)
					}
					testenv.WaitFor(t, "the fleet to hold nothing", func() bool { return f.held() == 0 })
					r.settled(t)
					if v := r.srv.Counters.Values(); v.Retries != tc.retries || v.PausedRetries != tc.paused {
						t.Errorf("counters %+v", v)
					}
					r.ch.mu.Lock()
					defer r.ch.mu.Unlock()
					if fmt.Sprint(r.ch.released) != fmt.Sprint(tc.released) {
						t.Errorf("released as failed: %v, want %v", r.ch.released, tc.released)
					}
				})
			}
		})
	}
}

// TestClientLeaves: a client that leaves mid-request cancels both legs.
func TestClientLeaves(t *testing.T) {
	for _, m := range modes() {
		t.Run(name(m.proto, m.notify), func(t *testing.T) {
			f, r := faultFleet(t, m.proto, m.notify, fakepd.Options{PrefillDelay: time.Hour}, fakepd.Options{})
			ctx, cancel := context.WithCancel(context.Background())
			c := r.start(ctx, "/v1/completions", body("/v1/completions", "leaving", 4, true, ""))
			testenv.WaitFor(t, "the prefill to hold the request", func() bool {
				return statsOf(f.prefills[0]).Requests.Load() == 1 && (m.proto == pd.VLLM || f.decodes[0].Held() == 1)
			})
			cancel()
			testenv.WaitForWithin(t, "both legs to be cancelled", time.Second, func() bool {
				return f.held() == 0 && statsOf(f.prefills[0]).Aborted.Load() == 1
			})
			testenv.WaitFor(t, "the client call to end", c.done.Load)
			testenv.WaitFor(t, "Serve to count the departure", func() bool { return r.srv.Counters.ClientGone.Load() == 1 })
		})
	}
}
