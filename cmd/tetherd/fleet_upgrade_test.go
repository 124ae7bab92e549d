package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/fakeengine"
)

// An upgrade while the fleet is paused for a weight sync: the new tetherd
// inherits the phase and the versions (it keeps holding), the request
// the old one held goes to the new one (not kept to the old one's pause
// timeout), and the resume sent to the new one releases both, on the new
// weights; no engine got a request while paused.
func TestUpgradeWhilePaused(t *testing.T) {
	if testing.Short() {
		t.Skip("builds tetherd")
	}
	bin := build(t, t.TempDir(), "github.com/tether-rl/tether/cmd/tetherd")
	engines, err := fakeengine.StartFleet(2, fakeengine.Config{Kind: fakeengine.SGLang, DecodeStep: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		for _, e := range engines {
			e.Close()
		}
	}()
	pidfile := filepath.Join(t.TempDir(), "tetherd.pid")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--bpf", "off",
		"--pidfile", pidfile, "--worker", engines[0].URL(), "--worker", engines[1].URL(), "--drain-timeout", "30s")
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var logs logWatch
	go logs.run(stderr)
	pids := []int{cmd.Process.Pid}
	defer func() {
		for _, p := range pids {
			syscall.Kill(p, syscall.SIGKILL)
		}
		cmd.Wait()
	}()
	t.Cleanup(func() {
		if t.Failed() {
			logs.mu.Lock()
			for _, l := range logs.lines {
				t.Log(l)
			}
			logs.mu.Unlock()
		}
	})
	data := "http://" + logs.wait(t, `msg="tetherd serving" listen=(\S+)`)
	logs.wait(t, `msg="admin API serving" admin=(\S+)`)
	testenv.WaitFor(t, "the pidfile", func() bool { return readPid(pidfile) == pids[0] })

	post := func(url, body string) (int, string) {
		resp, err := http.Post(url, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatalf("POST %s: %v", url, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp.StatusCode, string(b)
	}
	if code, b := post(data+"/pause_generation", `{"mode":"abort"}`); code != 200 {
		t.Fatalf("pause: %d %s", code, b)
	}
	if code, b := post(data+"/update_weights_from_disk", `{"model_path":"/m","weight_version":"v5"}`); code != 200 {
		t.Fatalf("update: %d %s", code, b)
	}
	type out struct {
		code int
		body string
	}
	gen := func() chan out {
		ch := make(chan out, 1)
		go func() {
			c := &http.Client{Timeout: time.Minute, Transport: &http.Transport{DisableKeepAlives: true}}
			resp, err := c.Post(data+"/generate", "application/json", strings.NewReader(`{"text":"held across an upgrade","sampling_params":{"max_new_tokens":4}}`))
			if err != nil {
				ch <- out{0, err.Error()}
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			ch <- out{resp.StatusCode, string(b)}
		}()
		return ch
	}
	fleetState := func() (phase, target string, held int) {
		resp, err := http.Get(data + "/fleet") // the data port: only the newest process accepts there
		if err != nil {
			return "", "", -1
		}
		defer resp.Body.Close()
		var v struct {
			Phase         string `json:"phase"`
			TargetVersion string `json:"target_version"`
			Held          int    `json:"held"`
		}
		json.NewDecoder(resp.Body).Decode(&v)
		return v.Phase, v.TargetVersion, v.Held
	}
	first := gen()
	testenv.WaitFor(t, "a request held by the old tetherd", func() bool { _, _, h := fleetState(); return h == 1 })

	syscall.Kill(pids[0], syscall.SIGUSR2)
	testenv.WaitForWithin(t, "the new tetherd in the pidfile", time.Minute, func() bool {
		p := readPid(pidfile)
		return p != 0 && p != pids[0]
	})
	pids = append(pids, readPid(pidfile))
	// The new process holds: the phase and the target came with the
	// handed-over state; the old one's held request is now held there.
	var last string
	defer func() {
		if t.Failed() {
			t.Logf("last /fleet: %s", last)
		}
	}()
	testenv.WaitFor(t, "the new tetherd paused, at v5, holding the forwarded request", func() bool {
		p, v, h := fleetState()
		last = p + " " + v + " " + strconv.Itoa(h)
		return p == "paused" && v == "v5" && h == 1
	})
	second := gen()
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, _, h := fleetState()
		if h == 2 {
			break
		}
		select {
		case o := <-second:
			t.Fatalf("the second request was not held: %d %s", o.code, o.body)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the second request was not held (held: %d)", h)
		}
		time.Sleep(5 * time.Millisecond)
	}
	for i, e := range engines {
		if st := e.Stats(); st.Requests != 0 {
			t.Fatalf("engine %d got %d requests while the fleet was paused", i, st.Requests)
		}
	}
	if code, b := post(data+"/continue_generation", ""); code != 200 || !strings.Contains(b, `"released":2`) {
		t.Fatalf("resume through the new tetherd: %d %s", code, b)
	}
	for _, ch := range []chan out{first, second} {
		o := <-ch
		if o.code != 200 || !strings.Contains(o.body, `"weight_versions":["v5"]`) {
			t.Fatalf("a held request after the upgrade: %d %s", o.code, o.body)
		}
	}
	var parked int64
	for _, e := range engines {
		parked += e.Stats().ParkedWhilePaused
	}
	if parked != 0 {
		t.Fatalf("%d requests parked in a paused engine", parked)
	}
}
