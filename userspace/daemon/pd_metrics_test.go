package daemon

import (
	"bufio"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/fakepd"
	"github.com/tether-rl/tether/userspace/registry"
)

// TestPDWorkerFigures: a P/D request counts on each side's worker as a
// routed request counts on its worker: in flight on both while it runs
// (GET /workers' in_flight), then one request and one decision each
// (pd_prefill on the prefill, pd_decode on the decode: /workers'
// decisions, tether_worker_decisions_total, tether_route_decisions_total)
// and one 2xx answer each (tether_responses_total), for both protocols.
func TestPDWorkerFigures(t *testing.T) {
	for _, proto := range []PDProtocol{PDSGLang, PDVLLM} {
		t.Run(string(proto), func(t *testing.T) {
			// The decode streams slowly (100 tokens, 3 s) so that the
			// request still runs once the client has its first event.
			f := startPDFleet(t, proto, []fakepd.Options{{}}, []fakepd.Options{{TokenDelay: 30 * time.Millisecond}})
			base := "http://" + f.d.Addr()
			path := "/v1/completions"
			req, _ := http.NewRequest(http.MethodPost, base+path, strings.NewReader(pdBody(path, "count me on both", 100, true)))
			req.Header.Set("Content-Type", "application/json")
			c := &http.Client{Timeout: 30 * time.Second}
			defer c.CloseIdleConnections()
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			if resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
			br := bufio.NewReader(resp.Body)
			if _, err := br.ReadString('\n'); err != nil {
				t.Fatalf("first event: %v", err)
			}
			// While the answer streams, the request is in flight on both
			// sides: each counts it from the pair's choice to the
			// answer's end (the prefill too, whether or not its leg is
			// over: its KV is held for the decode).
			byRole := func() map[string]registry.Info {
				m := map[string]registry.Info{}
				for _, in := range f.d.Registry.List() {
					m[in.Role] = in
				}
				return m
			}
			if in := byRole()["decode"]; in.InFlight != 1 {
				t.Errorf("decode in flight %d while its answer streams", in.InFlight)
			}
			if in := byRole()["prefill"]; in.InFlight != 1 {
				t.Errorf("prefill in flight %d while the pair's answer streams", in.InFlight)
			}
			for {
				if _, err := br.ReadString('\n'); err != nil {
					break
				}
			}
			resp.Body.Close()
			testenv.WaitFor(t, "nothing in flight in tetherd", func() bool { return f.inFlight() == 0 })
			rec := httptest.NewRecorder()
			f.d.Metrics.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
			metrics := rec.Body.String()
			for role, reason := range map[string]string{"prefill": "pd_prefill", "decode": "pd_decode"} {
				in := byRole()[role]
				if in.Requests != 1 || in.InFlight != 0 || in.Errors != 0 {
					t.Errorf("%s: requests %d, in flight %d, errors %d", role, in.Requests, in.InFlight, in.Errors)
				}
				if len(in.Decisions) != 1 || in.Decisions[reason] != 1 {
					t.Errorf("%s: decisions %v, want %s 1", role, in.Decisions, reason)
				}
				for _, line := range []string{
					fmt.Sprintf(`tether_worker_decisions_total{reason=%q,slot="%d",url=%q} 1`, reason, in.Slot, in.URL),
					fmt.Sprintf(`tether_route_decisions_total{reason=%q} 1`, reason),
					fmt.Sprintf(`tether_responses_total{code_class="2xx",slot="%d",url=%q} 1`, in.Slot, in.URL),
					fmt.Sprintf(`tether_request_duration_seconds_count{slot="%d",url=%q} 1`, in.Slot, in.URL),
				} {
					if !strings.Contains(metrics, line) {
						t.Errorf("/metrics lacks %s", line)
					}
				}
			}
		})
	}
}
