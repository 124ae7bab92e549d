package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// restartRow is one proxy reloaded or upgraded again and again under load.
type restartRow struct {
	name     string
	events   int   // upgrades or reloads during the run
	requests int64 // completed by wrk
	failed   int64 // socket errors (connect, read, write, timeout) + non-2xx
	err      string
}

// phaseRestart drives the rps load (wrk, keep-alive session POSTs) at
// tetherd while it is upgraded in place (SIGUSR2) every second, and at
// nginx while it reloads (SIGHUP to the master: nginx -s reload) every
// second, and counts what failed for each.
func (b *bench) phaseRestart() []restartRow {
	dur := max(b.o.dur, 10*time.Second)
	ids := make([]string, len(b.workerPorts))
	for i := range ids {
		ids[i] = sessionID(i)
	}
	script, err := writeWrkScript(b.m.tmp, "restart", ids, false)
	if err != nil {
		return []restartRow{{name: "restart", err: err.Error()}}
	}
	run := func(name string, port int, event func() error) restartRow {
		row := restartRow{name: name}
		type out struct {
			r   wrkResult
			err error
		}
		done := make(chan out, 1)
		go func() {
			r, err := runWrk(b.ctx, b.wrkBin, fmt.Sprintf("http://127.0.0.1:%d", port), script, b.o.threads, b.o.conns, dur)
			done <- out{r, err}
		}()
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case o := <-done:
				if o.err != nil {
					row.err = firstLine(o.err.Error())
				}
				row.requests, row.failed = o.r.requests, o.r.errSocket+o.r.errStatus
				return row
			case <-tick.C:
				if err := event(); err != nil && row.err == "" {
					row.err = err.Error()
				}
				row.events++
			}
		}
	}
	var rows []restartRow
	if b.want("tetherd") {
		pidfile := filepath.Join(b.m.tmp, "tetherd-restart.pid")
		in, err := b.startTetherd("tetherd-restart", "--pidfile", pidfile, "--drain-timeout", "10s")
		if err != nil {
			rows = append(rows, restartRow{name: "tetherd", err: err.Error()})
		} else {
			rows = append(rows, run("tetherd: upgrade in place (SIGUSR2)", in.port, func() error {
				b, err := os.ReadFile(pidfile)
				if err != nil {
					return err
				}
				pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
				return syscall.Kill(pid, syscall.SIGUSR2)
			}))
			in.stop() // the process group: every generation
		}
	}
	if b.nginxBin != "" && b.want("nginx") {
		in, err := b.startNginx()
		if err != nil {
			rows = append(rows, restartRow{name: "nginx", err: err.Error()})
		} else {
			master := in.procs[0].pid()
			rows = append(rows, run("nginx: reload (nginx -s reload)", in.port, func() error {
				return syscall.Kill(master, syscall.SIGHUP)
			}))
			in.stop()
		}
	}
	return rows
}

// restartReport is the report's section for phaseRestart.
func restartReport(rows []restartRow) string {
	var w strings.Builder
	fmt.Fprintf(&w, "\n## Upgrades and reloads under load (one per second, keep-alive session POSTs)\n\n")
	fmt.Fprintf(&w, "| proxy | events | requests | failed |\n|---|---|---|---|\n")
	for _, r := range rows {
		if r.err != "" && r.requests == 0 {
			fmt.Fprintf(&w, "| %s | – | – | not measured: %s |\n", r.name, r.err)
			continue
		}
		fmt.Fprintf(&w, "| %s | %d | %d | **%d** |\n", r.name, r.events, r.requests, r.failed)
	}
	return w.String()
}
