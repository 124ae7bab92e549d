package deploy

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
)

// chromium runs headless Chromium on url and returns the DOM once the
// page's scripts ran for budget of virtual time (its timers: the page's
// refreshes), or writes a screenshot when shot is set.
func chromium(t *testing.T, bin, url string, budget time.Duration, shot string) string {
	t.Helper()
	args := []string{"--headless", "--disable-gpu", "--no-first-run", "--no-default-browser-check", "--hide-scrollbars",
		"--user-data-dir=" + t.TempDir(), "--virtual-time-budget=" + strconv.Itoa(int(budget.Milliseconds()))}
	if os.Geteuid() == 0 {
		args = append(args, "--no-sandbox") // Chromium refuses to sandbox as root
	}
	if shot != "" {
		args = append(args, "--screenshot="+shot, "--window-size=1500,1400")
	} else {
		args = append(args, "--dump-dom")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, append(args, url)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("chromium: %v\n%s", err, stderr.String())
	}
	return string(out)
}

var (
	rowRE     = regexp.MustCompile(`<tr class="worker" data-slot="(\d+)" data-state="([a-z]+)">`)
	bodyRE    = regexp.MustCompile(`<body data-seq="(\d+)" data-refreshes="(\d+)"`)
	phaseRE   = regexp.MustCompile(`id="fleet-phase" data-phase="([a-z]+)"`)
	heldRE    = regexp.MustCompile(`<span id="fleet-held">(\d+)</span>`)
	stepRE    = regexp.MustCompile(`<tr class="step" data-kind="([a-z]+)">`)
	listenRE  = regexp.MustCompile(`<tr class="listener" data-slot="(\d+)">`)
	failedRE  = regexp.MustCompile(`class="fail">\d+ failed`)
	reasonRE  = regexp.MustCompile(`<span class="reason">([^<]*)</span>`)
	chartRE   = regexp.MustCompile(`<polyline points="[^"]+"`)
	barRE     = regexp.MustCompile(`<span class="bar[^"]*" title="\d+%">`)
	syncRE    = regexp.MustCompile(`data-sync="(\d+)"`)
	versionRE = regexp.MustCompile(`<td>(v\d+)</td>`)
)

// page is what the test reads of the rendered page.
type page struct {
	dom       string
	states    map[int]string
	seq, refr int
	phase     string
	held      int
	steps     []string
}

func readPage(t *testing.T, dom string) page {
	t.Helper()
	p := page{dom: dom, states: map[int]string{}}
	for _, m := range rowRE.FindAllStringSubmatch(dom, -1) {
		slot, _ := strconv.Atoi(m[1])
		p.states[slot] = m[2]
	}
	if m := bodyRE.FindStringSubmatch(dom); m != nil {
		p.seq, _ = strconv.Atoi(m[1])
		p.refr, _ = strconv.Atoi(m[2])
	}
	if m := phaseRE.FindStringSubmatch(dom); m != nil {
		p.phase = m[1]
	}
	if m := heldRE.FindStringSubmatch(dom); m != nil {
		p.held, _ = strconv.Atoi(m[1])
	}
	for _, m := range stepRE.FindAllStringSubmatch(dom, -1) {
		p.steps = append(p.steps, m[1])
	}
	return p
}

// TestPageInBrowser loads GET /ui in headless Chromium against tetherd
// in front of fake engines under load, and reads the rendered page: a row
// per worker in its state, the fleet paused with requests held, then a
// fenced worker after a failed update, the sync's steps on the timeline,
// the listeners, the charts, and the page refreshing itself.
func TestPageInBrowser(t *testing.T) {
	bin := need(t, "chromium", "chromium")
	const token = "s3cret"
	fx := newFixture(t, 3, 1, token)
	answered, _ := fx.load(t, 8)
	testenv.WaitFor(t, "load and engine signals", func() bool {
		var st struct {
			Workers []struct {
				Engine *struct{ Signals bool } `json:"engine"`
			} `json:"workers"`
		}
		fx.adminGet(t, "/ui/state", &st)
		for _, w := range st.Workers {
			if w.Engine == nil || !w.Engine.Signals {
				return false
			}
		}
		return answered() > 50
	})
	url := fx.admin + "/ui?token=" + token

	// Without the token: no page.
	if dom := chromium(t, bin, fx.admin+"/ui", 2*time.Second, ""); rowRE.MatchString(dom) || !strings.Contains(dom, "admin token") {
		t.Fatalf("the page without the token:\n%.600s", dom)
	}

	// Serving: every worker's row, serving.
	p := readPage(t, chromium(t, bin, url, 7*time.Second, ""))
	if len(p.states) != 4 || p.phase != "serving" {
		t.Fatalf("serving: rows %v, phase %q\n%.2000s", p.states, p.phase, p.dom)
	}
	for slot, st := range p.states {
		if st != "serving" {
			t.Fatalf("slot %d is %q while the fleet serves", slot, st)
		}
	}
	// It refreshed itself: several answers rendered, the last one later
	// than the first.
	if p.refr < 2 || p.seq < 2 {
		t.Fatalf("the page did not update itself: %d refreshes, state %d", p.refr, p.seq)
	}
	if n := len(listenRE.FindAllString(p.dom, -1)); n != 2 {
		t.Fatalf("%d listener rows, want 2", n)
	}
	if n := len(barRE.FindAllString(p.dom, -1)); n < 4 {
		t.Fatalf("%d KV and share bars", n)
	}
	for _, want := range []string{"sglang", "vllm", "regular", "hash="} {
		if !strings.Contains(p.dom, want) {
			t.Fatalf("the page shows no %q", want)
		}
	}

	// Paused: the fleet's phase, the workers paused with the reason,
	// requests held; the pause and its quiesce on the timeline.
	if code, ans := fx.post(t, "/pause_generation", `{"mode":"abort"}`); code != 200 {
		t.Fatalf("pause: %d %v", code, ans)
	}
	testenv.WaitFor(t, "requests held", func() bool { return fx.d.Fleet.HeldNow() > 0 })
	p2 := readPage(t, chromium(t, bin, url, 5*time.Second, ""))
	if p2.phase != "paused" || p2.held == 0 {
		t.Fatalf("paused: phase %q, held %d", p2.phase, p2.held)
	}
	for slot, st := range p2.states {
		if st != "paused" {
			t.Fatalf("slot %d is %q in a paused fleet", slot, st)
		}
	}
	if !strings.Contains(p2.dom, "fleet paused (abort)") {
		t.Fatalf("no reason for the pause: %v", reasonRE.FindAllStringSubmatch(p2.dom, 3))
	}
	if strings.Join(p2.steps, ",") != "quiesce,pause" {
		t.Fatalf("timeline after the pause: %v", p2.steps)
	}
	if p2.seq <= p.seq {
		t.Fatalf("the state did not move on: %d then %d", p.seq, p2.seq)
	}

	// A failed update fences one engine; the resume releases the rest.
	fx.engines[1].SetFailUpdates(true)
	if code, _ := fx.post(t, "/update_weights_from_disk", `{"model_path":"/m","weight_version":"v2"}`); code == 200 {
		t.Fatal("an update with a refusing engine answered 200")
	}
	if code, ans := fx.post(t, "/continue_generation", ""); code != 200 {
		t.Fatalf("resume: %d %v", code, ans)
	}
	p3 := readPage(t, chromium(t, bin, url, 5*time.Second, ""))
	if p3.phase != "serving" || p3.states[1] != "fenced" || p3.states[0] != "serving" || p3.states[2] != "serving" {
		t.Fatalf("after the failed update: phase %q, rows %v", p3.phase, p3.states)
	}
	if !strings.Contains(p3.dom, "fleet target v2: no new work until it matches") {
		t.Fatalf("no reason for the fence: %v", reasonRE.FindAllStringSubmatch(p3.dom, 5))
	}
	if strings.Join(p3.steps, ",") != "quiesce,pause,update,resume" || !failedRE.MatchString(p3.dom) {
		t.Fatalf("timeline after the sync: %v (a failed step shown: %t)", p3.steps, failedRE.MatchString(p3.dom))
	}
	if len(versionRE.FindAllString(p3.dom, -1)) < 3 || len(syncRE.FindAllString(p3.dom, -1)) != 1 {
		t.Fatalf("weight versions or syncs missing")
	}
	if !chartRE.MatchString(p3.dom) {
		t.Log("no chart line yet (the first samples come 5 s apart)")
	}
}

// TestScreenshot writes the page under load, mid-sync, to
// docs/fleet-page.png when TETHER_SCREENSHOT=1 (run by hand; the png is
// committed).
func TestScreenshot(t *testing.T) {
	if os.Getenv("TETHER_SCREENSHOT") == "" {
		t.Skip("TETHER_SCREENSHOT=1 writes docs/fleet-page.png")
	}
	bin := need(t, "chromium", "chromium")
	fx := newFixture(t, 8, 0, "")
	fx.tokens = 600
	answered, _ := fx.load(t, 40)
	samples := func() int {
		var st struct {
			History []json.RawMessage `json:"history"`
		}
		fx.adminGet(t, "/ui/state", &st)
		return len(st.History)
	}
	testenv.WaitForWithin(t, "a minute of samples under load", 3*time.Minute, func() bool { return answered() > 0 && samples() >= 12 })
	fx.post(t, "/pause_generation", `{"mode":"abort"}`)
	fx.post(t, "/update_weights_from_disk", `{"model_path":"/m","weight_version":"v1"}`)
	fx.post(t, "/continue_generation", "")
	fx.engines[3].SetFailUpdates(true)
	fx.post(t, "/pause_generation", `{"mode":"abort"}`)
	fx.post(t, "/update_weights_from_disk", `{"model_path":"/m","weight_version":"v2"}`)
	fx.post(t, "/continue_generation", "")
	fx.d.Registry.Drain(fx.engines[5].URL())
	n := samples()
	testenv.WaitForWithin(t, "two samples after the syncs", time.Minute, func() bool { return samples() >= n+2 })
	out, _ := filepath.Abs("../docs/fleet-page.png")
	chromium(t, bin, fx.admin+"/ui", 4*time.Second, out)
	t.Logf("wrote %s", out)
}
