package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/tether-rl/tether/testenv/fakepd"
)

// The P/D phase: the proxy CPU of a request tetherd serves over a
// prefill/decode pair (SGLang's bootstrap rooms, vLLM's NIXL handoff),
// stated against a plain routed request, in the same run: tetherd in
// front of one fake regular engine (a fake vLLM engine answering the
// request whole, as it does without a handoff), and tetherd in front of a
// fake prefill and decode of each protocol (testenv/fakepd). The fakes run
// in a process of their own (tether-bench fakepd-fleet), so only tetherd's
// CPU is counted; the load is the same /v1/completions request (8 tokens,
// whole answer) from wrk, with the runs interleaved.

// pdBody is the request every P/D phase target is sent.
const pdBody = `{"model":"m","prompt":"Say hello in five words.","max_tokens":8}`

// pdFleetKinds are the phase's targets: the regular engine first (the
// baseline), then a pair of each protocol.
var pdFleetKinds = []string{"routed", "pd-sglang", "pd-vllm"}

type pdRow struct {
	kind    string
	samples []rpsSample
	err     string
}

// runFakePDFleet serves fake engines until killed ("tether-bench
// fakepd-fleet --listen ADDR --kind routed|pd-sglang|pd-vllm"): GET
// /health answers once they are up, GET /fleet their tetherd flags.
func runFakePDFleet(args []string) {
	fs := flag.NewFlagSet("fakepd-fleet", flag.ExitOnError)
	listen := fs.String("listen", "127.0.0.1:0", "listen address of /health and /fleet")
	kind := fs.String("kind", "routed", strings.Join(pdFleetKinds, ", "))
	_ = fs.Parse(args)
	var flags []string
	var o fakepd.Options
	fail := func(err error) {
		fmt.Fprintf(os.Stderr, "fakepd-fleet: %v\n", err)
		os.Exit(1)
	}
	switch *kind {
	case "routed":
		d, err := fakepd.StartVLLMDecode(o)
		if err != nil {
			fail(err)
		}
		flags = []string{"--worker", d.URL()}
	case "pd-sglang":
		p, err := fakepd.StartSGLangPrefill(o)
		if err != nil {
			fail(err)
		}
		d, err := fakepd.StartSGLangDecode(o)
		if err != nil {
			fail(err)
		}
		flags = []string{"--prefill", fmt.Sprintf("%s?bootstrap_port=%d", p.URL(), p.BootstrapPort()),
			"--decode", d.URL(), "--pd-protocol", "sglang"}
	case "pd-vllm":
		p, err := fakepd.StartVLLMPrefill(o)
		if err != nil {
			fail(err)
		}
		d, err := fakepd.StartVLLMDecode(o)
		if err != nil {
			fail(err)
		}
		flags = []string{"--prefill", p.URL(), "--decode", d.URL(), "--pd-protocol", "vllm"}
	default:
		fail(fmt.Errorf("unknown --kind %q", *kind))
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok\n") })
	mux.HandleFunc("GET /fleet", func(w http.ResponseWriter, r *http.Request) { json.NewEncoder(w).Encode(flags) })
	fail(http.ListenAndServe(*listen, mux))
}

// fleetFlags reads a fleet's tetherd flags.
func fleetFlags(port int) ([]string, error) {
	resp, err := healthClient.Get(fmt.Sprintf("http://127.0.0.1:%d/fleet", port))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var flags []string
	if err := json.NewDecoder(resp.Body).Decode(&flags); err != nil {
		return nil, fmt.Errorf("GET /fleet: %w", err)
	}
	return flags, nil
}

// pdConns is the phase's wrk connections: enough to keep a pair busy on a
// small host without the fakes' own process becoming the bound.
func (b *bench) pdConns() int { return min(b.o.conns, 32) }

func (b *bench) phasePD() []pdRow {
	if b.tetherdBin == "" {
		return []pdRow{{kind: "all", err: "tetherd not built (-only must include tetherd)"}}
	}
	self, err := os.Executable()
	if err != nil {
		return []pdRow{{kind: "all", err: err.Error()}}
	}
	script, err := writePDScript(b.m.tmp)
	if err != nil {
		return []pdRow{{kind: "all", err: err.Error()}}
	}
	rows := make([]pdRow, len(pdFleetKinds))
	ins := make([]*instance, len(pdFleetKinds))
	defer func() {
		for _, in := range ins {
			if in != nil {
				in.stop()
			}
		}
	}()
	for i, kind := range pdFleetKinds {
		rows[i].kind = kind
		in, err := b.startPDTarget(self, kind)
		if err != nil {
			rows[i].err = firstLine(err.Error())
			logf("!!! pd: %s: %v", kind, err)
			b.failed = true
			continue
		}
		ins[i] = in
	}
	for run := 1; run <= b.o.runs && b.ctx.Err() == nil; run++ {
		for i, in := range ins {
			if in == nil || b.ctx.Err() != nil {
				continue
			}
			url := fmt.Sprintf("http://127.0.0.1:%d", in.port)
			if b.o.warmup > 0 {
				_, _ = runWrk(b.ctx, b.wrkBin, url, script, b.o.threads, b.pdConns(), b.o.warmup)
			}
			// tetherd's CPU (procs[0]) is the figure; the fakes' (procs[1])
			// is shown beside it: on a small host their work can bound the
			// rate, and a proxy waiting on them is woken for every leg.
			c0, f0 := treeTicks(in.procs[0].pid()), treeTicks(in.procs[1].pid())
			res, err := runWrk(b.ctx, b.wrkBin, url, script, b.o.threads, b.pdConns(), b.o.dur)
			c1, f1 := treeTicks(in.procs[0].pid()), treeTicks(in.procs[1].pid())
			if err != nil {
				rows[i].err = firstLine(err.Error())
				logf("!!! pd: wrk against %s failed: %v", rows[i].kind, err)
				continue
			}
			s := rpsSample{run: run, rps: res.rps, p50: res.p50, p99: res.p99, requests: res.requests,
				errSocket: res.errSocket, errState: res.errStatus, cpuUsPerReq: -1, workerUsPerReq: -1}
			if res.requests > 0 {
				s.cpuUsPerReq = float64(c1-c0) * (1e6 / clockTicks) / float64(res.requests)
				s.workerUsPerReq = float64(f1-f0) * (1e6 / clockTicks) / float64(res.requests)
			}
			rows[i].samples = append(rows[i].samples, s)
			logf("pd run %d/%d %-10s %8.0f req/s  p99 %-9v tetherd CPU %.1f µs/req  fakes %.1f µs/req  errors %d/%d",
				run, b.o.runs, rows[i].kind, s.rps, s.p99, s.cpuUsPerReq, s.workerUsPerReq, s.errSocket, s.errState)
		}
	}
	return rows
}

// startPDTarget starts a fleet of kind and a tetherd in front of it, and
// checks that one request is answered 200.
func (b *bench) startPDTarget(self, kind string) (*instance, error) {
	fleet, fport, err := b.m.startServer(b.ctx, "fakepd-"+kind, self, func(port int) ([]string, error) {
		return []string{"fakepd-fleet", "--listen", fmt.Sprintf("127.0.0.1:%d", port), "--kind", kind}, nil
	}, "/health")
	if err != nil {
		return nil, err
	}
	flags, err := fleetFlags(fport)
	if err != nil {
		b.m.stop(fleet)
		return nil, err
	}
	in, err := b.startTetherdOn("tetherd-"+kind, flags)
	if err != nil {
		b.m.stop(fleet)
		return nil, err
	}
	in.procs = append(in.procs, fleet)
	stopT := in.stop
	in.stop = func() { stopT(); b.m.stop(fleet) }
	if err := checkPD(in.port); err != nil {
		in.stop()
		return nil, fmt.Errorf("tetherd %s: %w", strings.Join(flags, " "), err)
	}
	return in, nil
}

// checkPD sends one request through tetherd, waiting (bounded) for the
// fleet's engines to be found healthy.
func checkPD(port int) error {
	c := &http.Client{Timeout: 5 * time.Second}
	defer c.CloseIdleConnections()
	var last string
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		resp, err := c.Post(fmt.Sprintf("http://127.0.0.1:%d/v1/completions", port), "application/json", strings.NewReader(pdBody))
		if err != nil {
			last = err.Error()
			continue
		}
		buf, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		if resp.StatusCode == 200 && strings.Contains(string(buf), `"choices"`) {
			return nil
		}
		last = fmt.Sprintf("status %d: %.300s", resp.StatusCode, buf)
	}
	return fmt.Errorf("POST /v1/completions never answered 200 (last: %s)", last)
}

// writePDScript is wrk's script: the same POST on every request.
func writePDScript(dir string) (string, error) {
	path := dir + "/wrk-pd.lua"
	s := fmt.Sprintf(`-- generated by tether-bench
local req
function init(args)
  req = wrk.format("POST", "/v1/completions", { ["Content-Type"] = "application/json" }, %q)
end
function request() return req end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("TETHER_RESULT requests=%%d duration_us=%%d bytes=%%d p50_us=%%d p90_us=%%d p99_us=%%d max_us=%%d err_connect=%%d err_read=%%d err_write=%%d err_status=%%d err_timeout=%%d\n",
    summary.requests, summary.duration, summary.bytes,
    latency:percentile(50.0), latency:percentile(90.0), latency:percentile(99.0), latency.max,
    e.connect, e.read, e.write, e.status, e.timeout))
end
`, pdBody)
	return path, os.WriteFile(path, []byte(s), 0o644)
}

// pdMedian is the median CPU per request (tetherd's, the fakes') and rate
// of a row's runs.
func pdMedian(ss []rpsSample) (cpu, fakes, rps float64, errs int64) {
	var cs, fs, rs []float64
	for _, s := range ss {
		if s.cpuUsPerReq >= 0 {
			cs = append(cs, s.cpuUsPerReq)
		}
		if s.workerUsPerReq >= 0 {
			fs = append(fs, s.workerUsPerReq)
		}
		rs = append(rs, s.rps)
		errs += s.errSocket + s.errState
	}
	return median(cs), median(fs), median(rs), errs
}

func pdReport(rows []pdRow, conns, threads int, dur time.Duration) string {
	if len(rows) == 0 {
		return ""
	}
	var s strings.Builder
	s.WriteString("\n## P/D: a request over a prefill/decode pair against a routed request (tetherd's CPU)\n\n")
	fmt.Fprintf(&s, "The same `POST /v1/completions` (8 tokens, whole answer), wrk -t%d -c%d -d%v, runs interleaved; fake engines (testenv/fakepd) in a process of their own. "+
		"routed: tetherd in front of one regular engine (proxied on the event loop); pd-*: tetherd in front of one prefill and one decode (two legs, the body read whole and edited, the decode's answer relayed). Median of the runs. "+
		"The fakes' own CPU is shown beside tetherd's: where they take most of a small host, the P/D rate is theirs, and tetherd, "+
		"idle between legs, pays a wake-up for each (a routed request at its far higher rate finds its threads busy): the ratio is then an upper bound.\n\n",
		threads, conns, dur)
	s.WriteString("| target | req/s | tetherd CPU µs/req | × routed | fakes CPU µs/req | errors |\n|---|---:|---:|---:|---:|---:|\n")
	var base float64
	for _, r := range rows {
		if r.err != "" && len(r.samples) == 0 {
			fmt.Fprintf(&s, "| %s | failed: %s | | | | |\n", r.kind, r.err)
			continue
		}
		cpu, fakes, rps, errs := pdMedian(r.samples)
		if r.kind == "routed" {
			base = cpu
		}
		x := "—"
		if base > 0 && r.kind != "routed" {
			x = fmt.Sprintf("%.2f×", cpu/base)
		}
		fmt.Fprintf(&s, "| %s | %.0f | %.1f | %s | %.1f | %d |\n", r.kind, rps, cpu, x, fakes, errs)
	}
	return s.String()
}
