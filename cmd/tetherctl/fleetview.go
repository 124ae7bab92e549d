package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/tether-rl/tether/userspace/admin"
	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/history"
)

const fleetUsage = "fleet [watch [--interval 2s] [--count N]] [--admin HOST:PORT] [--token T] [--json]  the weight sync now: phase, held, each engine's state and version, the last sync's steps; watch: refreshed until Ctrl-C"

func fleetFlags() (*flag.FlagSet, adminOpts, *time.Duration, *int) {
	fs := flag.NewFlagSet("fleet", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	o := addAdminFlags(fs)
	interval := fs.Duration("interval", 2*time.Second, "watch: time between refreshes")
	count := fs.Int("count", 0, "watch: stop after this many frames (0: until Ctrl-C)")
	return fs, o, interval, count
}

// cmdFleet is `tetherctl fleet` and `tetherctl fleet watch`.
func cmdFleet(args []string, stdout io.Writer) error {
	fs, o, interval, count := fleetFlags()
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	watch := false
	switch {
	case len(pos) == 0:
	case len(pos) == 1 && pos[0] == "watch":
		watch = true
	default:
		return usagef("unexpected argument %q (want nothing or watch)", pos[0])
	}
	if *interval <= 0 || *count < 0 {
		return usagef("--interval must be > 0 and --count >= 0")
	}
	ac, err := newAdminClient(*o.admin, *o.token, 10*time.Second)
	if err != nil {
		return err
	}
	if !watch {
		return fleetOnce(stdout, ac, *o.asJSON)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return fleetWatch(ctx, stdout, ac, *interval, *count)
}

// fleetView is what `tetherctl fleet` shows: GET /ui/state, or GET /fleet
// from a tetherd without the page.
type fleetView struct {
	Fleet   *fleet.Report    `json:"fleet"`
	Workers []admin.UIWorker `json:"workers"`
	Syncs   []history.Sync   `json:"syncs"`
}

func readFleetView(ac *adminClient) (*fleetView, error) {
	body, err := ac.do("GET", "/ui/state", nil)
	if err != nil {
		var he *httpError
		if !errors.As(err, &he) || he.code != 404 {
			return nil, err
		}
		r, err := readFleet(ac) // an older tetherd
		if err != nil {
			return nil, err
		}
		return &fleetView{Fleet: r}, nil
	}
	var v fleetView
	if err := json.Unmarshal(body, &v); err != nil {
		return nil, fmt.Errorf("GET /ui/state: %w", err)
	}
	if v.Fleet == nil {
		return nil, errors.New("GET /ui/state: no fleet state in the answer")
	}
	return &v, nil
}

func fleetOnce(w io.Writer, ac *adminClient, asJSON bool) error {
	v, err := readFleetView(ac)
	if err != nil {
		return err
	}
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	}
	return v.print(w)
}

// fleetWatch prints the view every interval, the screen cleared before
// each frame as watch(1) does, until ctx ends (Ctrl-C) or after count
// frames (0: no bound). A frame that fails shows the error and the watch
// goes on.
func fleetWatch(ctx context.Context, w io.Writer, ac *adminClient, interval time.Duration, count int) error {
	t := time.NewTicker(interval)
	defer t.Stop()
	for n := 1; ; n++ {
		fmt.Fprintf(w, "\x1b[H\x1b[2JEvery %s: tetherctl fleet (%s)    %s\n\n", interval, ac.base, time.Now().Format("15:04:05"))
		if v, err := readFleetView(ac); err != nil {
			fmt.Fprintf(w, "not read: %v\n", err)
		} else if err := v.print(w); err != nil {
			return err
		}
		if count > 0 && n >= count {
			return nil
		}
		select {
		case <-ctx.Done():
			fmt.Fprintln(w)
			return nil
		case <-t.C:
		}
	}
}

func (v *fleetView) print(w io.Writer) error {
	r := v.Fleet
	phase := r.Phase
	if r.Mode != "" {
		phase += " (" + r.Mode + ")"
	}
	target := r.TargetVersion
	if target == "" {
		target = "none set"
	}
	fmt.Fprintf(w, "FLEET %s for %.1fs · %d requests held (%d released, %d timed out, %d refused: hold full) · target version %s · epoch %d · %d pauses\n",
		phase, r.PhaseSinceS, r.Held, r.Released, r.HoldTimeouts, r.HoldFull, target, r.Epoch, r.Cycles)
	if r.ClusterLink == "down" {
		fmt.Fprintln(w, "cluster store out of sight: this replica holds generation requests until it sees it again")
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	if v.Workers != nil {
		fmt.Fprintln(tw, "SLOT\tENGINE\tSTATE\tWEIGHT_VERSION\tKV\tRUN/WAIT\tIN_FLIGHT\tURL\tWHY")
		for _, x := range v.Workers {
			kind, kv, rw := "-", "-", "-"
			ver := x.WeightVersion
			if e := x.Engine; e != nil {
				kind = e.Kind
				if e.KVUsage != nil {
					kv = fmt.Sprintf("%.0f%%", *e.KVUsage*100)
				}
				if e.Signals {
					rw = fmt.Sprintf("%d/%d", e.Running, e.Waiting)
				}
				if ver == "" {
					ver = e.WeightVersion
				}
			}
			if ver == "" {
				ver = "-"
			}
			fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\n", x.Slot, kind, x.View, ver, kv, rw, x.InFlight, x.URL, x.Reason)
		}
	} else {
		fmt.Fprintln(tw, "SLOT\tENGINE\tSTATE\tWEIGHT_VERSION\tIN_FLIGHT\tURL")
		for _, x := range r.Workers {
			v := x.WeightVersion
			if v == "" {
				v = "-"
			}
			fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\n", x.Slot, x.Engine, x.State, v, x.InFlight, x.URL)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(v.Syncs) == 0 {
		return nil
	}
	s := v.Syncs[0]
	state := "open"
	if s.End != nil {
		state = "done in " + s.End.Sub(s.Start).Round(time.Millisecond).String()
	}
	fmt.Fprintf(w, "\nLAST SYNC %d at %s (%s; held peak %d; %d engine calls failed)\n", s.ID, s.Start.Local().Format("15:04:05"), state, s.HeldPeak, s.Failed)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, st := range s.Steps {
		fmt.Fprintf(tw, "  %s\t%.3fs\t%s\t%s\n", st.Kind, st.DurationS, stepWhat(st), stepEngines(st))
	}
	if s.Dropped > 0 {
		fmt.Fprintf(tw, "  (%d more steps)\n", s.Dropped)
	}
	return tw.Flush()
}

func stepWhat(st history.Step) string {
	var parts []string
	switch st.Kind {
	case "quiesce":
		q := "quiet"
		if st.Quiet != nil && !*st.Quiet {
			q = fmt.Sprintf("NOT quiet: %d workers still running", st.StillRunning)
		}
		parts = append(parts, fmt.Sprintf("%s, %d abort waves, %s", st.Mode, st.AbortWaves, q))
	case "pause":
		parts = append(parts, fmt.Sprintf("%s, held %d", st.Path, st.Held))
	case "update":
		parts = append(parts, st.Path)
		if st.Version != "" {
			parts = append(parts, "version "+st.Version)
		}
	case "resume":
		parts = append(parts, fmt.Sprintf("%s, released %d", st.Path, st.Released))
	}
	if len(st.Fenced) > 0 {
		parts = append(parts, fmt.Sprintf("fenced %v", st.Fenced))
	}
	if st.Failed > 0 {
		parts = append(parts, fmt.Sprintf("%d FAILED (%d)", st.Failed, st.Status))
	}
	return strings.Join(parts, ", ")
}

func stepEngines(st history.Step) string {
	var b strings.Builder
	for i, c := range st.Engines {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "%d:%.3fs", c.Slot, c.DurationS)
		if c.Error != "" {
			b.WriteString("(" + c.Error + ")")
		}
	}
	return b.String()
}
