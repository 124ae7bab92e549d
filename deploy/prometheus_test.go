package deploy

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
)

func waitFor(t *testing.T, what string, cond func() bool) { testenv.WaitFor(t, what, cond) }

// dashboardQueries returns every query of deploy/grafana/tether.json,
// with Grafana's variables given the values a Prometheus can run:
// $instance (all), $__rate_interval.
func dashboardQueries(t *testing.T) map[string]string {
	t.Helper()
	b, err := os.ReadFile("grafana/tether.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		UID        string `json:"uid"`
		Title      string `json:"title"`
		Templating struct {
			List []struct{ Name string } `json:"list"`
		} `json:"templating"`
		Panels []struct {
			Type    string `json:"type"`
			Title   string `json:"title"`
			Targets []struct {
				Expr  string `json:"expr"`
				RefID string `json:"refId"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("tether.json: %v", err)
	}
	if d.UID == "" || d.Title == "" {
		t.Fatal("tether.json: no uid or title")
	}
	out := map[string]string{}
	r := strings.NewReplacer(`$instance`, `.*`, `$__rate_interval`, `1m`)
	for _, p := range d.Panels {
		if p.Type == "row" {
			continue
		}
		if len(p.Targets) == 0 {
			t.Fatalf("panel %q has no query", p.Title)
		}
		for _, x := range p.Targets {
			out[p.Title+" / "+x.RefID] = r.Replace(x.Expr)
		}
	}
	return out
}

func freePort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// TestDashboardAgainstPrometheus starts Prometheus scraping tetherd (its
// admin /metrics, with the token) in front of fake engines under load,
// after a weight sync, and runs every dashboard query through the query
// API: each must parse and return data.
func TestDashboardAgainstPrometheus(t *testing.T) {
	bin := need(t, "prometheus", "prometheus")
	queries := dashboardQueries(t)
	fx := newFixture(t, 2, 1, "tok")
	answered, _ := fx.load(t, 6)
	waitFor(t, "load", func() bool { return answered() > 20 })
	// A sync, so that the fleet's series (versions, pauses, hold) move.
	fx.post(t, "/pause_generation", `{"mode":"abort"}`)
	fx.post(t, "/update_weights_from_disk", `{"model_path":"/m","weight_version":"v1"}`)
	fx.post(t, "/continue_generation", "")

	dir := t.TempDir()
	target := strings.TrimPrefix(fx.admin, "http://")
	cfg := fmt.Sprintf(`global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - %s
scrape_configs:
  - job_name: tetherd
    authorization:
      credentials: tok
    static_configs:
      - targets: [%q]
`, mustAbs(t, "prometheus/tether-rules.yml"), target)
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	addr := freePort(t)
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, bin, "--config.file="+filepath.Join(dir, "prometheus.yml"), "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+addr, "--log.level=warn")
	var logs strings.Builder
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		cmd.Wait()
		if t.Failed() {
			t.Logf("prometheus:\n%s", logs.String())
		}
	})
	api := "http://" + addr
	query := func(q string) (string, int, error) {
		resp, err := http.Get(api + "/api/v1/query?query=" + url.QueryEscape(q))
		if err != nil {
			return "", 0, err
		}
		defer resp.Body.Close()
		var r struct {
			Status    string `json:"status"`
			ErrorType string `json:"errorType"`
			Error     string `json:"error"`
			Data      struct {
				Result []json.RawMessage `json:"result"`
			} `json:"data"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
			return "", 0, err
		}
		if r.Status != "success" {
			return r.ErrorType, 0, fmt.Errorf("%s: %s", r.ErrorType, r.Error)
		}
		return "", len(r.Data.Result), nil
	}
	testenv.WaitForWithin(t, "Prometheus scraping tetherd", 60*time.Second, func() bool {
		_, n, err := query(`up{job="tetherd"} == 1`)
		return err == nil && n == 1
	})
	for name, q := range queries {
		// A query that does not parse fails at once; one that returns
		// nothing is given the time for its rate windows to fill.
		if et, _, err := query(q); err != nil && et == "bad_data" {
			t.Fatalf("panel %s: the query does not parse: %v\n%s", name, err, q)
		}
		testenv.WaitForWithin(t, "panel "+name+" to return data from a tetherd under load: "+q, 45*time.Second, func() bool {
			_, n, err := query(q)
			if err != nil {
				t.Fatalf("panel %s: %v\n%s", name, err, q)
			}
			return n > 0
		})
	}
	t.Logf("%d dashboard queries returned data from Prometheus scraping tetherd", len(queries))
	// The rules load into a real Prometheus too.
	resp, err := http.Get(api + "/api/v1/rules")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var rr struct {
		Data struct {
			Groups []struct {
				Rules []struct {
					Name   string `json:"name"`
					Health string `json:"health"`
				} `json:"rules"`
			} `json:"groups"`
		} `json:"data"`
	}
	json.NewDecoder(resp.Body).Decode(&rr)
	n := 0
	for _, g := range rr.Data.Groups {
		for _, r := range g.Rules {
			n++
			if r.Health == "err" {
				t.Errorf("rule %s: evaluation fails in Prometheus", r.Name)
			}
		}
	}
	if n < 6 {
		t.Fatalf("Prometheus loaded %d rules", n)
	}
}

func mustAbs(t *testing.T, p string) string {
	a, err := filepath.Abs(p)
	if err != nil {
		t.Fatal(err)
	}
	return a
}
