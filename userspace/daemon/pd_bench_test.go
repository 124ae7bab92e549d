package daemon

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/tether-rl/tether/testenv/fakepd"
)

// BenchmarkPD: a P/D request (/v1/completions, 8 tokens, whole answer)
// on 2 prefills + 3 decodes, through tetherd and by fakepd's direct
// client (the protocol done by the client itself), in parallel.
func BenchmarkPD(b *testing.B) {
	for _, proto := range []PDProtocol{PDSGLang, PDVLLM} {
		b.Run(string(proto), func(b *testing.B) {
			o := fakepd.Options{}
			f := startPDFleet(b, proto, []fakepd.Options{o, o}, []fakepd.Options{o, o, o})
			path := "/v1/completions"
			body := pdBody(path, "a prompt of a benchmark", 8, false)
			c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
			defer c.CloseIdleConnections()
			b.Run("tetherd", func(b *testing.B) {
				base := "http://" + f.d.Addr()
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						if resp, out, err := pdPost(c, base, path, body, nil); err != nil || resp.StatusCode != 200 {
							b.Errorf("%v %v %s", err, resp, out)
							return
						}
					}
				})
			})
			b.Run("direct", func(b *testing.B) {
				var n atomic.Int64
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						i := int(n.Add(1))
						pi, di := i%2, i%3
						var st int
						var err error
						if proto == PDSGLang {
							st, _, err = fakepd.DirectSGLang(context.Background(), c, f.prefills[pi].URL(), f.ports[pi], f.decodes[di].URL(), path, []byte(body))
						} else {
							st, _, err = fakepd.DirectVLLM(context.Background(), c, f.prefills[pi].URL(), f.decodes[di].URL(), path, []byte(body))
						}
						if err != nil || st != 200 {
							b.Errorf("direct: %d %v", st, err)
							return
						}
					}
				})
			})
		})
	}
}
