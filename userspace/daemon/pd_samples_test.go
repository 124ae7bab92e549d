package daemon

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/fakepd"
)

// TestPDSplitSamples: through tetherd, a request for 3 samples (not
// streamed) is 3 requests of one over pairs, one answer with choices 0..2,
// each sample counted on its pair's workers; streamed, it is refused.
func TestPDSplitSamples(t *testing.T) {
	for _, proto := range []PDProtocol{PDSGLang, PDVLLM} {
		t.Run(string(proto), func(t *testing.T) {
			o := fakepd.Options{}
			f := startPDFleet(t, proto, []fakepd.Options{o}, []fakepd.Options{o, o})
			base := "http://" + f.d.Addr()
			c := &http.Client{}
			defer c.CloseIdleConnections()
			path := "/v1/chat/completions"
			body := strings.Replace(pdBody(path, "three samples", 4, false), `"stream":false`, `"stream":false,"n":3`, 1)
			resp, out, err := pdPost(c, base, path, body, nil)
			if err != nil || resp.StatusCode != 200 {
				t.Fatalf("%v %v %s", err, resp, out)
			}
			var a struct {
				Choices []struct {
					Index   int `json:"index"`
					Message struct {
						Content string `json:"content"`
					} `json:"message"`
				} `json:"choices"`
			}
			if err := json.Unmarshal(out, &a); err != nil || len(a.Choices) != 3 {
				t.Fatalf("%v %s", err, out)
			}
			for i, ch := range a.Choices {
				if ch.Index != i || ch.Message.Content != pdWant(path, "three samples", 4) {
					t.Errorf("choice %d: %+v", i, ch)
				}
			}
			if pairs := strings.Split(resp.Header.Get(RouteHeaderName), ", "); len(pairs) != 3 {
				t.Errorf("route header %q", resp.Header.Get(RouteHeaderName))
			}
			testenv.WaitFor(t, "nothing in flight in tetherd", func() bool { return f.inFlight() == 0 })
			testenv.WaitFor(t, "the fleet to hold nothing", func() bool { return f.held() == 0 })
			var pre, dec uint64
			for _, in := range f.d.Registry.List() {
				switch in.Role {
				case "prefill":
					pre += in.Requests
				case "decode":
					dec += in.Requests
				}
			}
			if pre != 3 || dec != 3 {
				t.Errorf("requests on prefills %d, decodes %d; want 3 each", pre, dec)
			}
			stream := strings.Replace(pdBody(path, "three streamed", 4, true), `"stream":true`, `"stream":true,"n":3`, 1)
			if resp, out, err := pdPost(c, base, path, stream, nil); err != nil || resp.StatusCode != 400 || !strings.Contains(string(out), "n > 1") {
				t.Errorf("streamed n: %v %v %s", err, resp, out)
			}
		})
	}
}
