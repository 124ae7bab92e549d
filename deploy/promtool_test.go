package deploy

import (
	"bytes"
	"io"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
)

// promtool runs promtool with args in deploy/prometheus and returns its
// output; a failure fails the test with it.
func promtool(t *testing.T, bin string, stdin io.Reader, args ...string) string {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Dir = "prometheus"
	cmd.Stdin = stdin
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

func TestRulesCheck(t *testing.T) {
	bin := need(t, "promtool", "prometheus")
	out := promtool(t, bin, nil, "check", "rules", "tether-rules.yml")
	if !strings.Contains(out, "SUCCESS") {
		t.Fatalf("promtool check rules:\n%s", out)
	}
}

func TestRulesUnitTests(t *testing.T) {
	bin := need(t, "promtool", "prometheus")
	promtool(t, bin, nil, "test", "rules", "tether-rules_test.yml")
}

// Every alert has a unit test in which it fires (a case with expected
// alerts), so a new rule cannot come without one.
func TestEveryAlertHasAFiringCase(t *testing.T) {
	rules, err := os.ReadFile("prometheus/tether-rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	tests, err := os.ReadFile("prometheus/tether-rules_test.yml")
	if err != nil {
		t.Fatal(err)
	}
	firing := map[string]bool{}
	// "alertname: X" followed (before the next alertname) by an
	// exp_alerts list with an entry.
	parts := regexp.MustCompile(`alertname: (\w+)`).FindAllSubmatchIndex(tests, -1)
	for i, p := range parts {
		end := len(tests)
		if i+1 < len(parts) {
			end = parts[i+1][0]
		}
		if bytes.Contains(tests[p[1]:end], []byte("exp_labels")) {
			firing[string(tests[p[2]:p[3]])] = true
		}
	}
	alerts := regexp.MustCompile(`(?m)^\s*- alert: (\w+)`).FindAllSubmatch(rules, -1)
	if len(alerts) < 6 {
		t.Fatalf("%d alerts in the rules", len(alerts))
	}
	for _, a := range alerts {
		if !firing[string(a[1])] {
			t.Errorf("alert %s has no promtool test case in which it fires", a[1])
		}
	}
}

// promtool check metrics on tetherd's exposition, under load and after a
// weight sync (every family present).
func TestMetricsExposition(t *testing.T) {
	bin := need(t, "promtool", "prometheus")
	fx := newFixture(t, 2, 1, "tok")
	answered, stop := fx.load(t, 4)
	waitFor(t, "requests answered", func() bool { return answered() > 20 })
	fx.post(t, "/pause_generation", `{"mode":"abort"}`)
	fx.post(t, "/update_weights_from_disk", `{"model_path":"/m","weight_version":"v1"}`)
	fx.post(t, "/continue_generation", "")
	stop()
	req, _ := http.NewRequest("GET", fx.admin+"/metrics", nil)
	req.Header.Set("Authorization", "Bearer tok")
	resp, err := fx.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, fam := range []string{"tether_fleet_phase", "tether_engine_kv_usage", "tether_worker_sync_state", "tether_upgrades_total", "tether_responses_total"} {
		if !bytes.Contains(body, []byte("\n"+fam)) {
			t.Fatalf("no %s in the exposition", fam)
		}
	}
	promtool(t, bin, bytes.NewReader(body), "check", "metrics")
}
