package daemon

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/worker"
	"github.com/tether-rl/tether/userspace/workerclient"
)

// TestLearnRole: a worker's role and bootstrap port from its engine's
// /server_info where they were not given; a given role stays, a given
// prefill without a port takes the engine's, else 8998.
func TestLearnRole(t *testing.T) {
	for _, c := range []struct {
		name, info string
		given      *registry.RoleSpec
		role       worker.Role
		port       int
	}{
		{"prefill", `{"disaggregation_mode":"prefill","disaggregation_bootstrap_port":9123}`, nil, worker.Prefill, 9123},
		{"prefill default port", `{"disaggregation_mode":"prefill"}`, nil, worker.Prefill, worker.DefaultBootstrapPort},
		{"decode", `{"disaggregation_mode":"decode","disaggregation_bootstrap_port":9123}`, nil, worker.Decode, 0},
		{"regular", `{"disaggregation_mode":"null"}`, nil, worker.Regular, 0},
		{"no field", `{"model_path":"m"}`, nil, worker.Regular, 0},
		{"not json", `<html>`, nil, worker.Regular, 0},
		{"given prefill, engine's port", `{"disaggregation_mode":"prefill","disaggregation_bootstrap_port":9124}`, &registry.RoleSpec{Role: worker.Prefill}, worker.Prefill, 9124},
		{"given decode stays", `{"disaggregation_mode":"prefill"}`, &registry.RoleSpec{Role: worker.Decode}, worker.Decode, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path != "/server_info" {
					http.NotFound(w, r)
					return
				}
				w.Write([]byte(c.info))
			}))
			defer srv.Close()
			p := &pdPlane{client: workerclient.New(workerclient.Options{})}
			defer p.client.Close()
			w := &worker.Worker{URL: srv.URL}
			var spec registry.RoleSpec
			if c.given != nil {
				spec = *c.given
				w.SetRole(spec.Role, spec.BootstrapPort)
			}
			p.learnRole(w, spec, c.given != nil)
			if w.Role() != c.role || w.BootstrapPort() != c.port {
				t.Errorf("role %v port %d, want %v %d", w.Role(), w.BootstrapPort(), c.role, c.port)
			}
		})
	}
}
