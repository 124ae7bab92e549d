package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"time"
)

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

type rpsSummary struct {
	ok                   bool
	rps, p50ms, p99ms    float64
	cpu, workerCPU       float64 // µs/req, cpu -1 when n/a
	syscalls, switches   float64 // per request, by perf; -1 when n/a
	errSocket, errStatus int64
	runs                 []float64
}

func summarize(t *target) rpsSummary {
	var s rpsSummary
	if len(t.rps) == 0 {
		return s
	}
	var rps, p50, p99, cpu, wcpu, sys, cs []float64
	for _, x := range t.rps {
		rps = append(rps, x.rps)
		p50 = append(p50, float64(x.p50)/float64(time.Millisecond))
		p99 = append(p99, float64(x.p99)/float64(time.Millisecond))
		cpu = append(cpu, x.cpuUsPerReq)
		sys = append(sys, x.syscallsPerReq)
		cs = append(cs, x.switchesPerReq)
		wcpu = append(wcpu, x.workerUsPerReq)
		s.errSocket += x.errSocket
		s.errStatus += x.errState
	}
	s.ok = true
	s.rps, s.p50ms, s.p99ms, s.cpu, s.workerCPU = median(rps), median(p50), median(p99), median(cpu), median(wcpu)
	s.syscalls, s.switches = median(sys), median(cs)
	s.runs = rps
	return s
}

// reportNewConn writes the table of the newconn phase: every request on a
// new connection (Connection: close), and the targets for it.
func (b *bench) reportNewConn(w *strings.Builder) {
	fmt.Fprintf(w, "\n## New connection per request (%d connections, each request says Connection: close)\n\n", b.o.conns)
	fmt.Fprintf(w, "| target | req/s | p50 ms | p99 ms | proxy CPU µs/req | syscalls/req | ctx switches/req | socket errs / non-2xx | req/s per run |\n")
	fmt.Fprintf(w, "|---|---:|---:|---:|---:|---:|---:|---:|---|\n")
	shadow := map[string]*target{}
	cell := func(v float64, f string) string {
		if v < 0 {
			return "n/a"
		}
		return fmt.Sprintf(f, v)
	}
	for _, t := range b.targets {
		st := &target{name: t.name, rps: t.rpsNew}
		shadow[t.name] = st
		s := summarize(st)
		if !s.ok {
			continue
		}
		fmt.Fprintf(w, "| %s | %.0f | %.2f | %.2f | %s | %s | %s | %d / %d | %s |\n", t.name, s.rps, s.p50ms, s.p99ms,
			cell(s.cpu, "%.1f"), cell(s.syscalls, "%.2f"), cell(s.switches, "%.2f"), s.errSocket, s.errStatus, fmtList(s.runs, 0))
	}
	td, ng := shadow["tetherd"], shadow["nginx"]
	if td == nil || ng == nil || !summarize(td).ok || !summarize(ng).ok {
		return
	}
	cr := runRatio(td, ng, func(x rpsSample) float64 { return x.cpuUsPerReq })
	rr := runRatio(td, ng, func(x rpsSample) float64 { return x.rps })
	fmt.Fprintf(w, "\n- tetherd/nginx: req/s **%.2f×** (per run %s), CPU per request %.2f× (per run %s)\n", median(rr), fmtList(rr, 2), median(cr), fmtList(cr, 2))
	fmt.Fprintf(w, "  - target req/s ≥ 1.0× nginx: %s; CPU per request ≤ nginx's: %s\n", passMiss(median(rr) >= 1.0), passMiss(median(cr) <= 1.0))
}

// runRatio returns per-run ratios a/b of a metric, matching runs by index.
func runRatio(a, b *target, f func(rpsSample) float64) []float64 {
	var out []float64
	for _, x := range a.rps {
		for _, y := range b.rps {
			if x.run == y.run && f(y) > 0 && f(x) >= 0 {
				out = append(out, f(x)/f(y))
			}
		}
	}
	return out
}

func fmtList(xs []float64, prec int) string {
	var p []string
	for _, x := range xs {
		p = append(p, fmt.Sprintf("%.*f", prec, x))
	}
	return strings.Join(p, ", ")
}

func toolVersion(bin string, args ...string) string {
	if bin == "" {
		return "not installed"
	}
	out, _ := exec.Command(bin, args...).CombinedOutput()
	line, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
	return strings.TrimSpace(line)
}

func passMiss(ok bool) string {
	if ok {
		return "PASS"
	}
	return "MISS"
}

func (b *bench) report(bal balanceResult) string {
	o := b.o
	var w strings.Builder
	fmt.Fprintf(&w, "# tether-bench results\n\n")
	fmt.Fprintf(&w, "- date: %s\n", time.Now().Format(time.RFC3339))
	end := loadAvg()
	fmt.Fprintf(&w, "- load average at start / end: %s / %s (other work on the machine skews every number)\n", b.loadStart, end)
	if busy(b.loadStart) || busy(end) {
		fmt.Fprintf(&w, "- **WARNING: the machine was busy with other work (1-min load > %d cores): treat these numbers as noisy; the per-run columns show the spread**\n", runtime.NumCPU())
	}
	fmt.Fprintf(&w, "- machine: %d cores, %s/%s, harness %s; everything (wrk, proxy, 4 workers) shares these cores over loopback\n", runtime.NumCPU(), runtime.GOOS, runtime.GOARCH, runtime.Version())
	fmt.Fprintf(&w, "- workers: 4 × %s; wrk: %s; nginx: %s; haproxy: %s\n", b.demoNote,
		toolVersion(b.wrkBin, "-v"), strings.TrimPrefix(toolVersion(b.nginxBin, "-v"), "nginx version: "), strings.TrimPrefix(toolVersion(b.haproxyBin, "-v"), "HAProxy version "))
	fmt.Fprintf(&w, "- load: `wrk -t%d -c%d -d%ds --latency`, keep-alive POST /sessions/w<k>-<32hex>/v1/chat/completions (%d-byte JSON), ids round-robin over the 4 workers (direct: worker 0 only); %d interleaved runs per target, median shown; each proxy started fresh per run with a %v warm-up\n",
		o.threads, o.conns, int(o.dur/time.Second), len(chatBody), o.runs, o.warmup)
	if b.bpffsNote != "" {
		fmt.Fprintf(&w, "- bpffs: %s\n", b.bpffsNote)
	}
	if b.steerNote != "" {
		fmt.Fprintf(&w, "- steering: %s\n", b.steerNote)
	}
	fmt.Fprintf(&w, "- CPU: utime+stime of the proxy's process tree from /proc (10 ms ticks); workers' CPU shown for context\n")
	fmt.Fprintf(&w, "- syscalls and context switches per request: `perf stat -e raw_syscalls:sys_enter,context-switches` on the proxy's processes over the middle %v of each measured run, divided by the requests wrk counted in that span (n/a without perf)\n", o.dur-time.Second)
	for _, t := range b.targets {
		switch {
		case t.skip != "":
			fmt.Fprintf(&w, "- **%s skipped: %s**\n", t.name, t.skip)
		case t.broken != "":
			fmt.Fprintf(&w, "- **%s FAILED: %s**\n", t.name, t.broken)
		}
	}
	if b.tetherdErr != "" {
		fmt.Fprintf(&w, "- **tetherd build error:** `%s`\n", firstLine(b.tetherdErr))
	}

	sums := map[string]rpsSummary{}
	if o.phases["rps"] {
		fmt.Fprintf(&w, "\n## Keep-alive requests (%d connections)\n\n", o.conns)
		fmt.Fprintf(&w, "| target | req/s | p50 ms | p99 ms | proxy CPU µs/req | syscalls/req | ctx switches/req | workers CPU µs/req | socket errs / non-2xx | req/s per run |\n")
		fmt.Fprintf(&w, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
		for _, t := range b.targets {
			s := summarize(t)
			sums[t.name] = s
			if !s.ok {
				continue
			}
			cpu := "n/a"
			if s.cpu >= 0 {
				cpu = fmt.Sprintf("%.1f", s.cpu)
			}
			perfCell := func(v float64) string {
				if v < 0 {
					return "n/a"
				}
				return fmt.Sprintf("%.2f", v)
			}
			fmt.Fprintf(&w, "| %s | %.0f | %.2f | %.2f | %s | %s | %s | %.1f | %d / %d | %s |\n", t.name, s.rps, s.p50ms, s.p99ms, cpu,
				perfCell(s.syscalls), perfCell(s.switches), s.workerCPU, s.errSocket, s.errStatus, fmtList(s.runs, 0))
		}
		td := b.targetByName("tetherd")
		cpuOf := func(x rpsSample) float64 { return x.cpuUsPerReq }
		rpsOf := func(x rpsSample) float64 { return x.rps }
		if td != nil && sums["tetherd"].ok {
			w.WriteString("\n")
			for _, other := range []string{"nginx", "haproxy", "caddy", "gnet-exp"} {
				ot := b.targetByName(other)
				if ot == nil || !sums[other].ok {
					continue
				}
				cr := runRatio(td, ot, cpuOf)
				rr := runRatio(td, ot, rpsOf)
				fmt.Fprintf(&w, "- tetherd/%s: CPU per request **%.2f×** (per run %s), req/s %.2f× (per run %s)\n",
					other, median(cr), fmtList(cr, 2), median(rr), fmtList(rr, 2))
				if other == "nginx" {
					// The event-loop issue's keep-alive targets.
					fmt.Fprintf(&w, "  - target CPU per request ≤ 0.75× nginx: %s; req/s ≥ 1.15× nginx: %s\n",
						passMiss(median(cr) <= 0.75), passMiss(median(rr) >= 1.15))
				}
			}
			if sc := sums["tetherd"].syscalls; sc >= 0 {
				fmt.Fprintf(&w, "- tetherd system calls per proxied request %.2f (target ≤ 4: %s), context switches %.2f; nginx %.2f and %.2f\n",
					sc, passMiss(sc <= 4), sums["tetherd"].switches, sums["nginx"].syscalls, sums["nginx"].switches)
			}
			if d := sums["direct"]; d.ok {
				fmt.Fprintf(&w, "- tetherd/direct: req/s %.2f×, p99 %+.2f ms\n", sums["tetherd"].rps/d.rps, sums["tetherd"].p99ms-d.p99ms)
			}
			if td.logNote != "" {
				fmt.Fprintf(&w, "- tetherd (default flags) logged: `%s`\n", td.logNote)
			}
		}
	}
	if o.phases["newconn"] {
		b.reportNewConn(&w)
	}
	if o.phases["rps"] {
		// Steering.
		td := b.targetByName("tetherd")
		cpuOf := func(x rpsSample) float64 { return x.cpuUsPerReq }
		rpsOf := func(x rpsSample) float64 { return x.rps }
		nb := b.targetByName("tetherd-nobpf")
		if td != nil && nb != nil && sums["tetherd"].ok && sums["tetherd-nobpf"].ok {
			a, c := sums["tetherd"], sums["tetherd-nobpf"]
			fmt.Fprintf(&w, "\n## Steering: tetherd default vs --bpf=off (same run)\n\n")

			fmt.Fprintf(&w, "| | default | --bpf=off | default/off |\n|---|---:|---:|---:|\n")
			fmt.Fprintf(&w, "| req/s | %.0f | %.0f | %.2f× (per run %s) |\n", a.rps, c.rps, a.rps/c.rps, fmtList(runRatio(td, nb, rpsOf), 2))
			fmt.Fprintf(&w, "| proxy CPU µs/req | %.1f | %.1f | %.2f× (per run %s) |\n", a.cpu, c.cpu, a.cpu/c.cpu, fmtList(runRatio(td, nb, cpuOf), 2))
			fmt.Fprintf(&w, "| p99 ms | %.2f | %.2f | |\n", a.p99ms, c.p99ms)
		}
	}

	if o.phases["bodies"] {
		fmt.Fprintf(&w, "\n## %d MiB bodies (Go client, keep-alive, sequential, %v per direction per run, %d interleaved runs, median)\n\n", o.bodyMB, o.bodyDur, o.runs)
		fmt.Fprintf(&w, "MB = 10^6 bytes, GB = 10^9 bytes; CPU s/GB is the proxy's CPU seconds per GB relayed. Upload: POST /sessions/w<k>-<id>/sha256 (digest checked); download: GET /sessions/w<k>-<id>/blob?size=%d&seed=1; chunked: the same with &chunked=1 (no Content-Length; the demo writes and flushes 64 KiB chunks), its body checked against the download's digest.\n\n", o.bodyMB<<20)
		fmt.Fprintf(&w, "| target | upload MB/s | ×direct | upload CPU s/GB | download MB/s | ×direct | download CPU s/GB | chunked MB/s | ×direct | chunked CPU s/GB | MB/s per run (up; down; chunked) | notes |\n")
		fmt.Fprintf(&w, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|\n")
		d := b.targetByName("direct")
		ratio := func(x, y bodySum) string {
			if y.mbps == 0 {
				return "-"
			}
			return fmt.Sprintf("%.2f", x.mbps/y.mbps)
		}
		for _, t := range b.targets {
			if !t.hasBody {
				continue
			}
			var notes []string
			if t.up.err != "" {
				notes = append(notes, "upload error: "+firstLine(t.up.err))
			}
			if t.down.err != "" {
				notes = append(notes, "download error: "+firstLine(t.down.err))
			}
			if t.chunked.err != "" {
				notes = append(notes, "chunked error: "+firstLine(t.chunked.err))
			}
			if t.chunked.note != "" {
				notes = append(notes, "chunked: "+firstLine(t.chunked.note))
			}
			if d.hasBody && t != d && d.down.digest != "" && t.down.digest != "" && t.down.digest != d.down.digest {
				notes = append(notes, "download digest differs from direct")
			}
			if d.hasBody && t != d && d.down.digest != "" && t.chunked.digest != "" && t.chunked.digest != d.down.digest {
				notes = append(notes, "chunked digest differs from direct")
			}
			cpu := func(r bodySum) string {
				if t.name == "direct" {
					return "n/a"
				}
				return fmt.Sprintf("%.3f", r.cpuPerGB)
			}
			fmt.Fprintf(&w, "| %s | %.0f | %s | %s | %.0f | %s | %s | %.0f | %s | %s | %s; %s; %s | %s |\n", t.name,
				t.up.mbps, ratio(t.up, d.up), cpu(t.up), t.down.mbps, ratio(t.down, d.down), cpu(t.down),
				t.chunked.mbps, ratio(t.chunked, d.chunked), cpu(t.chunked),
				fmtList(t.up.runs, 0), fmtList(t.down.runs, 0), fmtList(t.chunked.runs, 0), strings.Join(notes, "; "))
		}
		var chunkNotes []string
		for _, t := range b.targets {
			if t.hasBody && t.chunked.chunks != nil {
				chunkNotes = append(chunkNotes, t.name+" "+fmtChunks(t.chunked.chunks))
			}
		}
		if len(chunkNotes) > 0 {
			fmt.Fprintf(&w, "\nChunks of the chunked download as the client received them (one unmeasured transfer, first run): %s.\n", strings.Join(chunkNotes, "; "))
		}
		if td := b.targetByName("tetherd"); td != nil && td.hasBody && d.hasBody {
			w.WriteString("\nTargets (tetherd ≥ 0.8× direct, ≤ 0.10 CPU s/GB):\n")
			for _, x := range []struct {
				n    string
				r, z bodySum
			}{{"upload", td.up, d.up}, {"download", td.down, d.down}, {"download, chunked", td.chunked, d.chunked}} {
				r := 0.0
				if x.z.mbps > 0 {
					r = x.r.mbps / x.z.mbps
				}
				fmt.Fprintf(&w, "- %s: %.2f× direct %s; %.3f CPU s/GB %s\n", x.n, r, passMiss(r >= 0.8),
					x.r.cpuPerGB, passMiss(x.r.mbps > 0 && x.r.cpuPerGB <= 0.10))
			}
		}
	}

	if o.phases["balance"] {
		fmt.Fprintf(&w, "\n## Listener balance (tetherd --listeners %d, %d connections)\n\n", o.balanceL, o.conns)
		if bal.ran {
			mm, list := maxMean(bal.actives)
			fmt.Fprintf(&w, "- active connections per listener (mid-run, %d active listeners): [%s]; max/mean = **%.2f** (1.00 is perfect); %.0f req/s\n", len(bal.actives), list, mm, bal.rps)
			am, alist := maxMean(bal.accepted)
			fmt.Fprintf(&w, "- accepted so far per listener (incl. the bench's health and routing checks): [%s]; max/mean = %.2f\n", alist, am)
			if len(bal.actives) != o.balanceL {
				fmt.Fprintf(&w, "- note: asked for %d listeners, tetherctl shows %d active\n", o.balanceL, len(bal.actives))
			}
		} else {
			fmt.Fprintf(&w, "- %s\n", bal.note)
		}
	}
	return w.String()
}

// parseListeners reads {"listeners":[{"slot":0,"state":"active","active":N,"accepted":N},...],...}
// and keeps the listeners in the "active" state (all of them if no state is given).
func parseListeners(b []byte) (active, accepted []int64, states []string, err error) {
	var st struct {
		Listeners []struct {
			Slot     int    `json:"slot"`
			State    string `json:"state"`
			Active   *int64 `json:"active"`
			Accepted int64  `json:"accepted"`
		} `json:"listeners"`
	}
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, nil, nil, fmt.Errorf("%v in %.200s", err, b)
	}
	sort.Slice(st.Listeners, func(i, j int) bool { return st.Listeners[i].Slot < st.Listeners[j].Slot })
	for _, l := range st.Listeners {
		if l.State != "" && !strings.EqualFold(l.State, "active") {
			continue
		}
		if l.Active == nil {
			return nil, nil, nil, fmt.Errorf("listener slot %d has no active count", l.Slot)
		}
		active = append(active, *l.Active)
		accepted = append(accepted, l.Accepted)
		states = append(states, l.State)
	}
	if len(active) == 0 {
		return nil, nil, nil, fmt.Errorf("no active listeners in %.300s", b)
	}
	return active, accepted, states, nil
}

// maxMean returns max/mean of xs (0 when the mean is 0).
func maxMean(xs []int64) (float64, string) {
	var sum, mx int64
	var ps []string
	for _, x := range xs {
		sum += x
		if x > mx {
			mx = x
		}
		ps = append(ps, fmt.Sprint(x))
	}
	if sum == 0 {
		return 0, strings.Join(ps, " ")
	}
	return float64(mx) / (float64(sum) / float64(len(xs))), strings.Join(ps, " ")
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

// busy reports whether a loadavg string's 1-minute figure exceeds the cores.
func busy(load string) bool {
	f := strings.Fields(load)
	if len(f) == 0 {
		return false
	}
	v, err := strconv.ParseFloat(f[0], 64)
	return err == nil && v > float64(runtime.NumCPU())
}
