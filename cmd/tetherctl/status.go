package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"sort"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/tether-rl/tether/bpf"
	"github.com/tether-rl/tether/userspace/cluster"
	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/stats"
)

// Status is what `tetherctl status` reports (also its --json form).
type Status struct {
	PinDir string `json:"pin_dir"`
	// Running: some listener slot holds a socket (the kernel drops a
	// closed socket from listener_sockets, so a killed tetherd shows too).
	Running   bool             `json:"running"`
	Listeners []ListenerStatus `json:"listeners"`
	Decisions bpf.Decisions    `json:"decisions"`
	Workers   []WorkerStatus   `json:"workers"`
	// CurrentKnown: the admin API said which slots hold a worker now
	// (WorkerStatus.Current); CurrentError says why not.
	CurrentKnown bool   `json:"current_known"`
	CurrentError string `json:"current_error,omitempty"`
	// Routing comes from the admin API (GET /routing), not the maps: the
	// routing decisions by reason. RoutingError says why it is missing.
	Routing      *RoutingStatus `json:"routing,omitempty"`
	RoutingError string         `json:"routing_error,omitempty"`
	// Cluster is the admin API's GET /cluster (cluster mode only).
	Cluster *cluster.Status `json:"cluster,omitempty"`
	// Fleet is the admin API's GET /fleet: the weight sync (fleet.go).
	Fleet *fleet.Report `json:"fleet,omitempty"`
	// Run: the counters since this tetherd started (run.go; GET
	// /baseline); Workers and Listeners are the pinned totals, earlier
	// runs included.
	Run      *RunStatus `json:"this_run,omitempty"`
	RunError string     `json:"this_run_error,omitempty"`
}

// RoutingStatus is the admin API's GET /routing.
type RoutingStatus struct {
	Policy    string            `json:"policy"`
	Decisions map[string]uint64 `json:"decisions"`
	Learned   *struct {
		Learned   uint64 `json:"learned"`
		NoID      uint64 `json:"no_id"`
		Forgotten uint64 `json:"forgotten"`
	} `json:"learned_sessions,omitempty"`
	StickyShared bool `json:"sticky_shared"`
}

// ListenerStatus is one listener slot that is in use or has counted anything.
type ListenerStatus struct {
	Slot     int    `json:"slot"`
	State    string `json:"state"`
	Weight   uint32 `json:"weight"`
	Active   uint64 `json:"active"`
	Accepted uint64 `json:"accepted"`
	Closed   uint64 `json:"closed"`
	Selected uint64 `json:"selected"`
	Migrated uint64 `json:"migrated"`
}

// WorkerStatus is one worker slot with a nonzero counter, or that holds a
// worker now.
type WorkerStatus struct {
	Slot int `json:"slot"`
	// Current: the slot holds a worker now (URL, State: from the admin
	// API). False: its counters are left from a worker of an earlier run,
	// or one removed since (the pinned maps outlive tetherd by design).
	// Absent when the admin API was not asked or did not answer.
	Current   *bool  `json:"current,omitempty"`
	URL       string `json:"url,omitempty"`
	State     string `json:"state,omitempty"`
	InFlight  uint64 `json:"in_flight"`
	Requests  uint64 `json:"requests"`
	Errors    uint64 `json:"errors"`
	BytesUp   uint64 `json:"bytes_up"`
	BytesDown uint64 `json:"bytes_down"`
	Retries   uint64 `json:"retries"`
	Conns     uint64 `json:"conns"`
	// Engine: what the worker's engine last reported (GET /workers
	// "engine"; the load poller).
	Engine *EngineStatus `json:"engine,omitempty"`
	// Decisions: the requests routed to the worker by reason (GET
	// /workers "decisions").
	Decisions map[string]uint64 `json:"decisions,omitempty"`
	// Pinned: the keys and sessions the sticky table holds for the worker
	// (GET /workers "pinned").
	Pinned *int `json:"pinned,omitempty"`
	// KVEvents: the worker's KV-event subscriptions, one per DP rank
	// (GET /workers "kv_events"; kvstatus.go).
	KVEvents []KVEventsStatus `json:"kv_events,omitempty"`
}

// EngineStatus is a worker's engine as GET /workers shows it.
type EngineStatus struct {
	Kind          string   `json:"kind"`
	Signals       bool     `json:"signals"`
	Running       int      `json:"running"`
	Waiting       int      `json:"waiting"`
	KVUsage       *float64 `json:"kv_usage"`
	PrefixHitRate *float64 `json:"prefix_hit_rate"`
	WeightVersion string   `json:"weight_version,omitempty"`
	Vetoed        bool     `json:"vetoed"`
}

type statusOpts struct {
	pinDir, admin, token *string
	asJSON               *bool
}

func statusFlags() (*flag.FlagSet, statusOpts) {
	fs, pinDir := newFlags("status")
	return fs, statusOpts{
		pinDir: pinDir,
		asJSON: fs.Bool("json", false, "print JSON"),
		admin:  fs.String("admin", DefaultAdmin, "tetherd's admin API, HOST:PORT (as tetherd's --admin) or http://HOST:PORT: which slots hold a worker now, routing decisions (\"off\": skip)"),
		token:  fs.String("token", "", "admin token (default: $TETHER_ADMIN_TOKEN)"),
	}
}

func cmdStatus(args []string, stdout io.Writer) error {
	fs, o := statusFlags()
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usagef("unexpected argument %q", pos[0])
	}
	var ac *adminClient
	if *o.admin != "off" && *o.admin != "" {
		if ac, err = newAdminClient(*o.admin, *o.token, 2*time.Second); err != nil {
			return err
		}
	}
	return status(stdout, *o.pinDir, *o.asJSON, ac)
}

// status prints tetherd's listeners and workers from the maps pinned in
// pinDir, opened read-only, and the routing decisions from the admin API
// (when ac is set and answers).
func status(w io.Writer, pinDir string, asJSON bool, ac *adminClient) error {
	st, err := readStatus(pinDir)
	if err != nil {
		return err
	}
	if ac != nil {
		if err := st.readCurrent(ac); err != nil {
			st.CurrentError = err.Error()
		}
		st.Routing, err = readRouting(ac)
		if err != nil {
			st.RoutingError = err.Error()
		}
		st.Fleet, _ = readFleet(ac) // absent from a tetherd without it
		if st.CurrentKnown {
			if err := st.readRun(ac); err != nil {
				st.RunError = err.Error()
			}
		}
		if body, err := ac.do("GET", "/cluster", nil); err == nil {
			var cs cluster.Status
			if json.Unmarshal(body, &cs) == nil {
				st.Cluster = &cs
			}
		}
	}
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		err = enc.Encode(st)
	} else {
		err = st.print(w)
	}
	if err == nil && !st.Running {
		err = fmt.Errorf("tetherd is not running: no listener socket in %s/listener_sockets (the counters shown are from its last run)", pinDir)
	}
	return err
}

// readCurrent asks the admin API which slots hold a worker now: each slot
// is marked current or not, and a current worker without a counter yet is
// listed too.
func (st *Status) readCurrent(ac *adminClient) error {
	body, err := ac.do("GET", "/workers", nil)
	if err != nil {
		return err
	}
	var l struct {
		Workers []workerJSON `json:"workers"`
	}
	if err := json.Unmarshal(body, &l); err != nil {
		return fmt.Errorf("GET /workers: %w", err)
	}
	now := make(map[int]workerJSON, len(l.Workers))
	for _, w := range l.Workers {
		now[w.Slot] = w
	}
	for i := range st.Workers {
		ws := &st.Workers[i]
		w, ok := now[ws.Slot]
		ws.Current = &ok
		if ok {
			ws.URL, ws.State = w.URL, w.State
			delete(now, ws.Slot)
		}
	}
	for slot, w := range now {
		yes := true
		st.Workers = append(st.Workers, WorkerStatus{Slot: slot, Current: &yes, URL: w.URL, State: w.State})
	}
	sort.Slice(st.Workers, func(i, j int) bool { return st.Workers[i].Slot < st.Workers[j].Slot })
	var le struct {
		Workers []struct {
			Slot      int               `json:"slot"`
			Engine    *EngineStatus     `json:"engine"`
			Decisions map[string]uint64 `json:"decisions"`
			Pinned    *int              `json:"pinned"`
			KVEvents  []KVEventsStatus  `json:"kv_events"`
		} `json:"workers"`
	}
	if json.Unmarshal(body, &le) == nil {
		for _, e := range le.Workers {
			for i := range st.Workers {
				if st.Workers[i].Slot != e.Slot {
					continue
				}
				if e.Engine != nil {
					st.Workers[i].Engine = e.Engine
				}
				st.Workers[i].Decisions, st.Workers[i].Pinned = e.Decisions, e.Pinned
				st.Workers[i].KVEvents = e.KVEvents
			}
		}
	}
	st.CurrentKnown = true
	return nil
}

// readRouting asks the admin API for the routing decision counts.
func readRouting(ac *adminClient) (*RoutingStatus, error) {
	body, err := ac.do("GET", "/routing", nil)
	if err != nil {
		return nil, err
	}
	var rs RoutingStatus
	if err := json.Unmarshal(body, &rs); err != nil {
		return nil, fmt.Errorf("GET /routing: %w", err)
	}
	return &rs, nil
}

func readStatus(pinDir string) (*Status, error) {
	s, err := openPins(pinDir, true)
	if err != nil {
		return nil, err
	}
	defer s.Close()
	slots, err := s.Slots()
	if err != nil {
		return nil, err
	}
	d, err := s.Decisions()
	if err != nil {
		return nil, err
	}
	serving, err := s.Serving()
	if err != nil {
		return nil, err
	}
	st := &Status{PinDir: pinDir, Running: len(serving) > 0, Decisions: d, Listeners: []ListenerStatus{}, Workers: []WorkerStatus{}}
	for _, sl := range slots {
		if sl.State == bpf.SlotEmpty && sl.Load.Accepted == 0 && sl.Load.Active == 0 && sl.Selected == 0 && sl.Migrated == 0 {
			continue
		}
		st.Listeners = append(st.Listeners, ListenerStatus{
			Slot: sl.Slot, State: sl.State.String(), Weight: max(sl.Weight, 1),
			Active: sl.Load.Active, Accepted: sl.Load.Accepted, Closed: sl.Load.Closed,
			Selected: sl.Selected, Migrated: sl.Migrated,
		})
	}
	for i := range bpf.MaxWorkers {
		c := s.Stats().Worker(i).Load()
		if c == (stats.WorkerSnapshot{}) {
			continue
		}
		st.Workers = append(st.Workers, WorkerStatus{
			Slot: i, InFlight: c.InFlight, Requests: c.Requests, Errors: c.Errors,
			BytesUp: c.BytesUp, BytesDown: c.BytesDown, Retries: c.Retries, Conns: c.Conns,
		})
	}
	return st, nil
}

func (st *Status) print(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "pins: %s\n\nLISTENERS (pinned totals)\n", st.PinDir)
	fmt.Fprintln(tw, "SLOT\tSTATE\tWEIGHT\tACTIVE\tACCEPTED\tCLOSED\tSELECTED\tMIGRATED")
	for _, l := range st.Listeners {
		fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%d\t%d\t%d\t%d\n", l.Slot, l.State, l.Weight, l.Active, l.Accepted, l.Closed, l.Selected, l.Migrated)
	}
	if len(st.Listeners) == 0 {
		fmt.Fprintln(tw, "(none)")
	}
	d := st.Decisions
	fmt.Fprintf(tw, "steering: %d migrated, %d to kernel hash (no active slot), %d to kernel hash (select failed)\n\nWORKERS: PINNED TOTALS (the BPF maps keep them across runs and upgrades: earlier runs included; this run's: THIS RUN below)\n",
		d.Migrated, d.FallbackNoSlot, d.FallbackSelectErr)
	header := "SLOT\tIN_FLIGHT\tREQUESTS\tERRORS\tBYTES_UP\tBYTES_DOWN\tRETRIES\tCONNS"
	if st.CurrentKnown {
		header += "\tWORKER NOW"
	}
	fmt.Fprintln(tw, header)
	stale := 0
	for _, x := range st.Workers {
		fmt.Fprintf(tw, "%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d", x.Slot, x.InFlight, x.Requests, x.Errors, x.BytesUp, x.BytesDown, x.Retries, x.Conns)
		switch {
		case !st.CurrentKnown || x.Current == nil:
		case *x.Current:
			fmt.Fprintf(tw, "\t%s (%s)", x.URL, x.State)
		default:
			stale++
			fmt.Fprint(tw, "\t(none: stale counters)")
		}
		fmt.Fprintln(tw)
	}
	if len(st.Workers) == 0 {
		fmt.Fprintln(tw, "(none with a nonzero counter)")
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	switch {
	case stale > 0:
		what := "slots hold"
		if stale == 1 {
			what = "slot holds"
		}
		fmt.Fprintf(w, "%d %s no worker now: the counters shown are from an earlier run or a removed worker (the pinned maps keep them)\n", stale, what)
	case !st.CurrentKnown && st.CurrentError != "":
		fmt.Fprintf(w, "which slots hold a worker now: not known, the admin API did not answer (%s); counters may be from an earlier run\n", st.CurrentError)
	case !st.CurrentKnown && len(st.Workers) > 0:
		fmt.Fprintln(w, "which slots hold a worker now: not asked (--admin off); counters may be from an earlier run")
	}
	if err := st.printRun(w); err != nil {
		return err
	}
	if st.Run == nil && st.RunError != "" {
		fmt.Fprintf(w, "this run's counters: not known (%s)\n", st.RunError)
	}
	if err := st.printEngines(w); err != nil {
		return err
	}
	if err := st.printKVEvents(w); err != nil {
		return err
	}
	if err := st.printRouting(w); err != nil {
		return err
	}
	if err := st.printWorkerDecisions(w); err != nil {
		return err
	}
	if err := st.printFleet(w); err != nil {
		return err
	}
	return st.printCluster(w)
}

// printCluster says whether the etcd link is up (cluster mode).
func (st *Status) printCluster(w io.Writer) error {
	c := st.Cluster
	if c == nil {
		return nil
	}
	link := "UP"
	if !c.Up {
		link = "DOWN: routing on the last table seen, admin writes answer 503 (" + c.LastError + ")"
	}
	_, err := fmt.Fprintf(w, "\nCLUSTER %s: link %s; %d workers at revision %d; %d changes applied, %d bad entries skipped\n",
		c.Name, link, c.Workers, c.Revision, c.Applied, c.Skipped)
	return err
}

// printRouting prints the routing decisions with a nonzero count: how many
// keyed requests stayed on their owner, spilled, came back, failed over,
// reached a learned session, or named a bad session.
func (st *Status) printRouting(w io.Writer) error {
	if st.Routing == nil {
		if st.RoutingError != "" {
			_, err := fmt.Fprintf(w, "\nROUTING: not available (%s)\n", st.RoutingError)
			return err
		}
		return nil
	}
	r := st.Routing
	fmt.Fprintf(w, "\nROUTING (policy %s)\n", r.Policy)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "REASON\tREQUESTS")
	names := make([]string, 0, len(r.Decisions))
	for name, n := range r.Decisions {
		if n > 0 {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	for _, name := range names {
		fmt.Fprintf(tw, "%s\t%d\n", name, r.Decisions[name])
	}
	if len(names) == 0 {
		fmt.Fprintln(tw, "(nothing routed yet)")
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	where := "in tetherd's memory (forgotten on restart)"
	if r.StickyShared {
		where = "in the pinned BPF map (kept across restarts)"
	}
	if l := r.Learned; l != nil {
		fmt.Fprintf(w, "learned sessions: %d learned, %d create answers without an id, %d forgotten; sticky table %s\n", l.Learned, l.NoID, l.Forgotten, where)
	} else {
		fmt.Fprintf(w, "learned sessions: off; sticky table %s\n", where)
	}
	return nil
}

// printEngines shows each worker's engine as the load poller read it.
func (st *Status) printEngines(w io.Writer) error {
	has := false
	for _, x := range st.Workers {
		has = has || x.Engine != nil
	}
	if !has {
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "\nENGINES\nSLOT\tKIND\tRUNNING\tWAITING\tKV\tPREFIX_HIT\tVETOED\tWEIGHTS")
	pct := func(p *float64) string {
		if p == nil {
			return "-"
		}
		return fmt.Sprintf("%.2f", *p)
	}
	for _, x := range st.Workers {
		e := x.Engine
		if e == nil {
			continue
		}
		if !e.Signals {
			fmt.Fprintf(tw, "%d\t%s\t(no load signals: placed by in-flight count)\n", x.Slot, e.Kind)
			continue
		}
		ver := e.WeightVersion
		if ver == "" {
			ver = "-"
		}
		fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%s\t%s\t%t\t%s\n", x.Slot, e.Kind, e.Running, e.Waiting, pct(e.KVUsage), pct(e.PrefixHitRate), e.Vetoed, ver)
	}
	return tw.Flush()
}

// printWorkerDecisions shows, per worker, the requests routed to it by
// reason: which keys stayed put, which moved there, which groups landed.
func (st *Status) printWorkerDecisions(w io.Writer) error {
	has := false
	for _, x := range st.Workers {
		has = has || len(x.Decisions) > 0 || x.Pinned != nil
	}
	if !has {
		return nil
	}
	fmt.Fprintln(w, "\nKEYS AND DECISIONS PER WORKER (pinned: sticky keys, spills and learned sessions held for it; decisions: this process's, by reason)")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SLOT\tPINNED\tDECISIONS")
	for _, x := range st.Workers {
		if len(x.Decisions) == 0 && x.Pinned == nil {
			continue
		}
		pinned := "-"
		if x.Pinned != nil {
			pinned = strconv.Itoa(*x.Pinned)
		}
		names := make([]string, 0, len(x.Decisions))
		for name := range x.Decisions {
			names = append(names, name)
		}
		sort.Strings(names)
		line := ""
		for i, name := range names {
			if i > 0 {
				line += " "
			}
			line += fmt.Sprintf("%s=%d", name, x.Decisions[name])
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\n", x.Slot, pinned, line)
	}
	return tw.Flush()
}
