package admin

// The live page (GET /ui) and what it polls (GET /ui/state): one row per
// worker, the fleet's phase and hold, the last weight syncs, the
// listeners and the BPF steering balance, and the last 15 minutes of
// requests/s, held requests and KV usage (userspace/history). The page is
// files embedded in the binary (ui/), plain JS and inline SVG, no build
// step and no third-party script.
//
// The admin token is asked for as everywhere else; a browser, which
// cannot send a Bearer header on a navigation, opens /ui?token=TOKEN once:
// the token goes into a cookie (HttpOnly, SameSite=Strict, Path=/ui) and
// the page is loaded again without it in the URL. The cookie is taken on
// GET and HEAD of /ui paths only, never on an endpoint that changes
// anything.

import (
	"embed"
	"io/fs"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/history"
	"github.com/tether-rl/tether/userspace/registry"
)

//go:embed ui
var uiFiles embed.FS

// uiCookie holds the admin token for the page's own requests.
const uiCookie = "tether_admin_token"

// UIConfig feeds the live page; nil fields are left out of it.
type UIConfig struct {
	Instance string
	Started  time.Time
	// Listeners returns each listener slot's counters and, with BPF
	// steering, what the program decided.
	Listeners func() []Listener
	History   *history.Ring
	Syncs     *history.Syncs
	// Baseline returns the counters as they were when this tetherd
	// started (GET /baseline; the page's "this run" figures).
	Baseline func() Baseline
}

// Listener is one listener slot on the page.
type Listener struct {
	Slot     int    `json:"slot"`
	Active   uint64 `json:"active"`
	Accepted uint64 `json:"accepted"`
	Closed   uint64 `json:"closed"`
	// Selected and Migrated: the BPF program's steering (new connections
	// steered here, queued ones moved here); Steered false without BPF.
	Steered  bool    `json:"steered"`
	Selected uint64  `json:"selected"`
	Migrated uint64  `json:"migrated"`
	Share    float64 `json:"share"` // of the connections steered (with BPF) or accepted, 0..1
}

// Baseline is GET /baseline: the pinned counters at this tetherd's start
// (they outlive it: BPF maps), so that a reader can tell this run's
// counts from the totals.
type Baseline struct {
	Instance  string           `json:"instance_id"`
	Started   time.Time        `json:"started"`
	Workers   []WorkerBaseline `json:"workers"`
	Listeners []ListenerCounts `json:"listeners"`
}

// WorkerBaseline is one worker slot's counters at the start.
type WorkerBaseline struct {
	Slot      int    `json:"slot"`
	Requests  uint64 `json:"requests"`
	Errors    uint64 `json:"errors"`
	BytesUp   uint64 `json:"bytes_up"`
	BytesDown uint64 `json:"bytes_down"`
	Retries   uint64 `json:"retries"`
}

// ListenerCounts is one listener slot's counters at the start.
type ListenerCounts struct {
	Slot     int    `json:"slot"`
	Accepted uint64 `json:"accepted"`
	Closed   uint64 `json:"closed"`
}

// Since returns the part of now counted after base: a counter below its
// base was reset since (the slot was given to another worker), so all of
// it is this run's.
func Since(now, base uint64) uint64 {
	if now < base {
		return now
	}
	return now - base
}

// UIWorker is one row of the page: the worker as GET /workers shows it,
// its state on the page and why.
type UIWorker struct {
	registry.Info
	Role string `json:"role"` // regular (prefill/decode workers are not routed yet)
	// View: serving, paused, updating, fenced, draining, unhealthy,
	// pending or removed; Reason says why it is not serving.
	View   string `json:"view"`
	Reason string `json:"reason,omitempty"`
	// RunRequests and RunErrors: counted since this tetherd started.
	RunRequests uint64 `json:"run_requests"`
	RunErrors   uint64 `json:"run_errors"`
}

// UIState is GET /ui/state.
type UIState struct {
	Seq       uint64          `json:"seq"` // answers served: the page shows it changing
	Instance  string          `json:"instance_id"`
	Now       time.Time       `json:"now"`
	Started   time.Time       `json:"started"`
	Fleet     any             `json:"fleet,omitempty"`
	Total     int             `json:"total"`
	Healthy   int             `json:"healthy"`
	Panic     bool            `json:"panic"`
	Workers   []UIWorker      `json:"workers"`
	Listeners []Listener      `json:"listeners"`
	Syncs     []history.Sync  `json:"syncs"`
	History   []history.Point `json:"history"` // oldest first; with ?since=T only those after T
	Cluster   any             `json:"cluster,omitempty"`
}

func (s *Server) routeUI(m *http.ServeMux) {
	m.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/ui", http.StatusFound)
	})
	m.HandleFunc("GET /ui", s.uiPage)
	m.HandleFunc("GET /ui/state", s.uiState)
	sub, _ := fs.Sub(uiFiles, "ui")
	files := http.StripPrefix("/ui/", http.FileServerFS(sub))
	m.Handle("GET /ui/{file}", files)
	m.HandleFunc("GET /baseline", s.baseline)
}

// isUIPath: the paths the page's cookie is good for.
func isUIPath(p string) bool { return p == "/" || p == "/ui" || strings.HasPrefix(p, "/ui/") }

// uiAuthorized takes the token from the page's cookie or ?token= (GET
// and HEAD of the page's paths only).
func (s *Server) uiAuthorized(r *http.Request) bool {
	if (r.Method != http.MethodGet && r.Method != http.MethodHead) || !isUIPath(r.URL.Path) {
		return false
	}
	if c, err := r.Cookie(uiCookie); err == nil && s.tokenIs(c.Value) {
		return true
	}
	return s.tokenIs(r.URL.Query().Get("token"))
}

func (s *Server) uiPage(w http.ResponseWriter, r *http.Request) {
	if t := r.URL.Query().Get("token"); t != "" && s.tokenIs(t) {
		http.SetCookie(w, &http.Cookie{Name: uiCookie, Value: t, Path: "/ui", HttpOnly: true, SameSite: http.SameSiteStrictMode})
		http.Redirect(w, r, "/ui", http.StatusFound)
		return
	}
	b, err := uiFiles.ReadFile("ui/index.html")
	if err != nil {
		writeError(w, http.StatusInternalServerError, "page missing from the binary")
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; script-src 'self'")
	w.Write(b)
}

func (s *Server) baseline(w http.ResponseWriter, r *http.Request) {
	if s.cfg.UI == nil || s.cfg.UI.Baseline == nil {
		writeError(w, http.StatusNotFound, "no baseline")
		return
	}
	writeJSON(w, http.StatusOK, s.cfg.UI.Baseline())
}

var uiSeq atomic.Uint64

// State returns what GET /ui/state answers: the history's samples after
// since (zero: all of them; the page asks only for the new ones).
func (s *Server) State(since time.Time) UIState {
	st := UIState{Seq: uiSeq.Add(1), Now: time.Now().UTC(), Workers: []UIWorker{}, Listeners: []Listener{}, Syncs: []history.Sync{}, History: []history.Point{}}
	var rep *fleet.Report
	if s.cfg.Fleet != nil {
		st.Fleet = s.cfg.Fleet()
		if r, ok := st.Fleet.(fleet.Report); ok {
			rep = &r
		}
	}
	var base map[int]WorkerBaseline
	if u := s.cfg.UI; u != nil {
		st.Instance, st.Started = u.Instance, u.Started.UTC()
		if u.Listeners != nil {
			st.Listeners = u.Listeners()
		}
		if u.Syncs != nil {
			st.Syncs = u.Syncs.List()
		}
		if u.History != nil {
			st.History = u.History.Since(since)
		}
		if u.Baseline != nil {
			b := u.Baseline()
			base = make(map[int]WorkerBaseline, len(b.Workers))
			for _, x := range b.Workers {
				base[x.Slot] = x
			}
		}
	}
	if s.cfg.Cluster != nil {
		st.Cluster = s.cfg.Cluster()
	}
	st.Panic = s.cfg.Registry.Panic()
	for _, in := range s.cfg.Registry.List() {
		if s.cfg.Decorate != nil {
			s.cfg.Decorate(&in)
		}
		if in.State != registry.StatePending && in.State != registry.StateRemoved {
			st.Total++
			if in.Healthy {
				st.Healthy++
			}
		}
		b := base[in.Slot]
		uw := UIWorker{Info: in, Role: "regular", RunRequests: Since(in.Requests, b.Requests), RunErrors: Since(in.Errors, b.Errors)}
		uw.View, uw.Reason = view(in, rep)
		st.Workers = append(st.Workers, uw)
	}
	return st
}

func (s *Server) uiState(w http.ResponseWriter, r *http.Request) {
	var since time.Time
	if v := r.URL.Query().Get("since"); v != "" {
		t, err := time.Parse(time.RFC3339Nano, v)
		if err != nil {
			writeError(w, http.StatusBadRequest, "since: want an RFC 3339 time (a sample's \"t\")")
			return
		}
		since = t
	}
	w.Header().Set("Cache-Control", "no-store")
	writeJSON(w, http.StatusOK, s.State(since))
}

// view names a worker's state on the page and the reason it is not
// serving (or what limits it).
func view(in registry.Info, rep *fleet.Report) (string, string) {
	switch in.State {
	case registry.StatePending:
		return "pending", "waiting for a first good health check"
	case registry.StateRemoved:
		return "removed", "removed: finishing its requests"
	}
	st := in.SyncState
	if st == "" {
		st = map[string]string{registry.StateHealthy: "serving"}[in.State]
		if st == "" {
			st = in.State
		}
	}
	switch st {
	case "updating":
		return st, "its weights are being updated: no new work"
	case "fenced":
		target := ""
		if rep != nil {
			target = rep.TargetVersion
		}
		v := in.WeightVersion
		if v == "" && in.Engine != nil {
			v = in.Engine.WeightVersion // what the engine itself last said
		}
		if v == "" {
			v = "unknown"
		}
		return st, "weight version " + v + ", fleet target " + target + ": no new work until it matches"
	case "paused":
		why := "fleet paused"
		if rep != nil {
			why = "fleet " + rep.Phase
			if rep.Mode != "" {
				why += " (" + rep.Mode + ")"
			}
			why += " for " + strconv.FormatFloat(rep.PhaseSinceS, 'f', 1, 64) + " s"
		}
		return st, why + ": generation requests held"
	case "unhealthy":
		why := "health checks failing"
		if in.ConsecutiveFailures > 0 {
			why += " (" + strconv.Itoa(in.ConsecutiveFailures) + " in a row)"
		}
		if in.LastError != "" {
			why += ": " + in.LastError
		}
		return st, why
	case "draining":
		return st, "draining: no new sessions or keys, existing ones go on"
	}
	if e := in.Engine; e != nil && e.Vetoed {
		why := "engine vetoed (no new keys, sessions or keyless work)"
		if e.KVUsage != nil {
			why += ": KV " + strconv.Itoa(int(*e.KVUsage*100+0.5)) + "%"
		}
		why += ", " + strconv.Itoa(e.Waiting) + " waiting"
		return st, why
	}
	return st, ""
}
