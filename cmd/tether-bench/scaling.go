package main

import (
	"fmt"
	"runtime"
	"strings"
	"time"
)

// The scaling phase: tetherd on 1 core, then 2, ... up to this machine's
// (GOMAXPROCS=N and --listeners N), the same wrk load each time: does
// throughput grow with cores? Beyond this machine, see docs/operations.md
// (run `make bench BENCHFLAGS=-phases=scaling` on a bigger host).

type scalingRow struct {
	cores    int
	rps, cpu float64
	err      string
}

func (b *bench) phaseScaling() []scalingRow {
	t := b.targetByName("tetherd")
	if t == nil || !b.active(t) {
		return nil
	}
	script, err := writeWrkScript(b.m.tmp, "wrk-scaling", b.idsFor(t), false)
	if err != nil {
		return nil
	}
	var rows []scalingRow
	for n := 1; n <= runtime.NumCPU() && b.ctx.Err() == nil; n *= 2 {
		b.m.env = []string{fmt.Sprintf("GOMAXPROCS=%d", n)}
		in, err := b.startTetherd("tetherd-scaling", "--listeners", fmt.Sprint(n))
		b.m.env = nil
		if err != nil {
			rows = append(rows, scalingRow{cores: n, err: firstLine(err.Error())})
			continue
		}
		url := fmt.Sprintf("http://127.0.0.1:%d", in.port)
		runWrk(b.ctx, b.wrkBin, url, script, b.o.threads, b.o.conns, time.Second)
		c0 := treeTicks(in.pids()...)
		res, err := runWrk(b.ctx, b.wrkBin, url, script, b.o.threads, b.o.conns, b.o.dur)
		c1 := treeTicks(in.pids()...)
		in.stop()
		row := scalingRow{cores: n}
		if err != nil {
			row.err = firstLine(err.Error())
		} else if res.requests > 0 {
			row.rps = res.rps
			row.cpu = float64(c1-c0) * (1e6 / clockTicks) / float64(res.requests)
		}
		logf("scaling: tetherd on %d core(s): %.0f req/s, %.1f µs CPU/req %s", n, row.rps, row.cpu, row.err)
		rows = append(rows, row)
	}
	return rows
}

func scalingReport(rows []scalingRow) string {
	if len(rows) == 0 {
		return ""
	}
	var s strings.Builder
	s.WriteString("\n## Scaling with cores (tetherd, GOMAXPROCS=N and --listeners N, same wrk load)\n\n")
	s.WriteString("wrk shares the machine: on a 2-core host the second core is partly wrk's and the workers'. Beyond this host: docs/operations.md.\n\n")
	s.WriteString("| cores | req/s | × 1 core | proxy CPU µs/req |\n|---:|---:|---:|---:|\n")
	for _, r := range rows {
		if r.err != "" {
			fmt.Fprintf(&s, "| %d | failed: %s | | |\n", r.cores, r.err)
			continue
		}
		x := 0.0
		if rows[0].rps > 0 {
			x = r.rps / rows[0].rps
		}
		fmt.Fprintf(&s, "| %d | %.0f | %.2f× | %.1f |\n", r.cores, r.rps, x, r.cpu)
	}
	return s.String()
}
