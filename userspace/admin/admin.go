// Package admin is tetherd's control API: the worker registry over HTTP,
// in sglang-router's legacy and REST forms, plus loads and metrics. It is
// served on its own listener (--admin, loopback by default) and, only with
// --admin-on-data-port, on the data port through the proxy's Local hook.
// With --admin-token every endpoint wants "Authorization: Bearer TOKEN".
//
//	POST   /add_worker?url=U        (or JSON body {"url":U})  sglang-router legacy
//	POST   /remove_worker?url=U     (or JSON body {"url":U})
//	GET    /list_workers            {"urls":[...]}
//	POST   /workers                 {"url":U[,"max_in_flight":N][,"worker_type":"regular"|"prefill"|"decode","bootstrap_port":P]}: answers once U passed a health check and routes;
//	                                re-adding a registered url is a no-op (200); worker_type names its P/D role (else learned from /server_info)
//	GET    /workers                 {"workers":[...],"total":n,"healthy":k,"panic":b}
//	GET    /workers/{id}            id: the worker's "id" (stable per url), slot number, or the url (URL-escaped)
//	DELETE /workers/{id}
//	PATCH  /workers/{id}            {"max_in_flight":N}: the worker's capacity (0: none)
//	POST   /workers/{id}/drain      no new sessions or keys; existing sessions go on
//	POST   /workers/{id}/undrain    routable again (weight-sync cycles)
//	GET    /get_loads, /v1/loads    {"loads":[{"worker":url,"worker_type":"regular","load":in_flight}],"total_workers":n} (also under "workers")
//	GET    /routing                 routing decisions by reason, learned session counts
//	GET    /metrics                 Prometheus
//	GET    /health                  tetherd's own health (admin listener)
//	GET    /ui                      the live page (ui.go); / redirects to it
//	GET    /ui/state                what the page polls: workers, fleet, syncs, listeners, history
//	GET    /baseline                the pinned counters at this tetherd's start (this run's counts)
//
// Errors are JSON: {"error":{"code":N,"message":"..."}}; bad input is a 4xx
// and changes nothing.
package admin

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"

	"github.com/tether-rl/tether/userspace/engine"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/worker"
)

// Config configures the admin API.
type Config struct {
	Registry *registry.Registry
	// Writer changes the worker table: nil, the registry itself (one
	// host); in cluster mode the cluster replica, which writes etcd and
	// returns once the change is applied here.
	Writer  Writer
	Metrics http.Handler // GET /metrics; nil: 404
	Health  http.Handler // GET /health on the admin listener; nil: {"status":"ok"}
	// Routing returns what GET /routing answers (JSON); nil: 404.
	Routing func() any
	// Fleet returns what GET /fleet answers (the weight sync's phase,
	// versions and hold: userspace/fleet); nil: 404.
	Fleet func() any
	// Decorate, when set, adds what other parts of tetherd know of a
	// worker (its weight version and sync state) to GET /workers.
	Decorate func(*registry.Info)
	// SetKVEvents, when set, takes an add's "kv_events" (tcp://host:port,
	// the worker's KV-event publisher) and "kv_events_replay".
	SetKVEvents func(url, endpoint, replay string) error
	// Cluster returns what GET /cluster answers (the etcd link's state);
	// nil (not in cluster mode): 404.
	Cluster func() any
	// Token, when set, is required as "Authorization: Bearer TOKEN" on
	// every endpoint, wherever it is served.
	Token string
	// UI feeds the live page (ui.go); nil: the page shows the workers
	// and the fleet only.
	UI  *UIConfig
	Log *slog.Logger
}

// Writer is what changes the worker table.
type Writer interface {
	Add(ctx context.Context, url string, origin registry.Origin) (registry.Info, error)
	Remove(id string) (registry.Info, error)
	Drain(id string) (registry.Info, error)
	Undrain(id string) (registry.Info, error)
	SetCapacity(url string, n uint64) (string, error)
}

// Server is the admin API, an http.Handler.
type Server struct {
	cfg   Config
	mux   *http.ServeMux
	token []byte
}

// maxBody bounds a control request's body.
const maxBody = 1 << 20

// New returns the admin API.
func New(cfg Config) *Server {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Writer == nil {
		cfg.Writer = cfg.Registry
	}
	s := &Server{cfg: cfg, mux: http.NewServeMux()}
	if cfg.Token != "" {
		s.token = []byte(cfg.Token)
	}
	m := s.mux
	m.HandleFunc("POST /add_worker", s.legacyAdd)
	m.HandleFunc("POST /remove_worker", s.legacyRemove)
	m.HandleFunc("GET /list_workers", s.listURLs)
	m.HandleFunc("POST /workers", s.create)
	m.HandleFunc("GET /workers", s.list)
	m.HandleFunc("GET /workers/{id}", s.get)
	m.HandleFunc("DELETE /workers/{id}", s.delete)
	m.HandleFunc("POST /workers/{id}/drain", s.drain)
	m.HandleFunc("POST /workers/{id}/undrain", s.undrain)
	m.HandleFunc("PATCH /workers/{id}", s.patch)
	m.HandleFunc("GET /routing", s.routing)
	m.HandleFunc("GET /fleet", s.fleet)
	m.HandleFunc("GET /cluster", s.cluster)
	m.HandleFunc("GET /get_loads", s.loads)
	m.HandleFunc("GET /v1/loads", s.loads)
	m.HandleFunc("GET /metrics", s.metrics)
	m.HandleFunc("GET /health", s.health)
	s.routeUI(m)
	return s
}

// ServeHTTP checks the token, then serves the endpoint.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if s.token != nil && !s.authorized(r) && !s.uiAuthorized(r) {
		w.Header().Set("WWW-Authenticate", `Bearer realm="tetherd"`)
		writeError(w, http.StatusUnauthorized, "missing or wrong admin token (Authorization: Bearer TOKEN)")
		return
	}
	h, pattern := s.mux.Handler(r)
	if pattern == "" {
		// The mux's own 404 or 405 (with Allow): answer it in JSON.
		h.ServeHTTP(&jsonErrorWriter{ResponseWriter: w}, r)
		return
	}
	s.mux.ServeHTTP(w, r)
}

func (s *Server) authorized(r *http.Request) bool {
	h := r.Header.Get("Authorization")
	const prefix = "Bearer "
	if len(h) <= len(prefix) || !strings.EqualFold(h[:len(prefix)], prefix) {
		return false
	}
	return s.tokenIs(strings.TrimSpace(h[len(prefix):]))
}

// tokenIs reports whether t is the admin token (set).
func (s *Server) tokenIs(t string) bool {
	return s.token != nil && t != "" && subtle.ConstantTimeCompare([]byte(t), s.token) == 1
}

// DataPort is the proxy's Local hook for --admin-on-data-port: it returns
// the admin API for its paths and nil (proxy it) for every other one. It
// does not allocate.
func (s *Server) DataPort(method, path []byte) http.Handler {
	if IsAdminPath(path) {
		return s
	}
	return nil
}

// IsAdminPath reports whether path (query included or not) is one of the
// admin API's paths, /health excepted.
func IsAdminPath(path []byte) bool {
	for i, c := range path {
		if c == '?' {
			path = path[:i]
			break
		}
	}
	switch string(path) {
	case "/add_worker", "/remove_worker", "/list_workers", "/workers", "/get_loads", "/v1/loads", "/metrics", "/routing", "/cluster",
		"/ui", "/baseline":
		return true
	}
	const p, u = "/workers/", "/ui/"
	return len(path) > len(p) && string(path[:len(p)]) == p || len(path) > len(u) && string(path[:len(u)]) == u
}

// workerSpec is what an add names: the url, and optionally the worker's
// capacity and its P/D role (sglang-router's worker_type and
// bootstrap_port, as slime and miles send them).
type workerSpec struct {
	URL         string  `json:"url"`
	MaxInFlight *uint64 `json:"max_in_flight"`
	// KV-cache events: the worker's publisher, its replay.
	KVEvents       string          `json:"kv_events"`
	KVEventsReplay string          `json:"kv_events_replay"`
	WorkerType     string          `json:"worker_type"`
	BootstrapPort  json.RawMessage `json:"bootstrap_port"`
}

// role reads the spec's worker_type and bootstrap_port; given is false
// when neither names one (the role is then learned from the engine).
func (s workerSpec) role() (spec registry.RoleSpec, given bool, err error) {
	r, err := worker.ParseRole(s.WorkerType)
	if err != nil {
		return spec, false, err
	}
	spec.Role = r
	if len(s.BootstrapPort) > 0 && string(s.BootstrapPort) != "null" {
		var port int
		if json.Unmarshal(s.BootstrapPort, &port) != nil || port <= 0 || port > 65535 {
			return spec, false, fmt.Errorf("bootstrap_port %s: want a port 1..65535 or null", s.BootstrapPort)
		}
		if r != worker.Prefill {
			return spec, false, errors.New("bootstrap_port: only a prefill worker has one")
		}
		spec.BootstrapPort = port
	}
	return spec, s.WorkerType != "", nil
}

// workerURL reads the url from the query (?url=U[&max_in_flight=N]) or a
// JSON body {"url":U[,"max_in_flight":N]}.
func workerURL(r *http.Request) (workerSpec, error) {
	q := r.URL.Query()
	if u := q.Get("url"); u != "" {
		spec := workerSpec{URL: u}
		if v := q.Get("max_in_flight"); v != "" {
			n, err := strconv.ParseUint(v, 10, 64)
			if err != nil {
				return spec, fmt.Errorf("max_in_flight %q: want a whole number >= 0", v)
			}
			spec.MaxInFlight = &n
		}
		return spec, nil
	}
	body, err := readBody(r)
	if err != nil {
		return workerSpec{}, err
	}
	if len(strings.TrimSpace(string(body))) == 0 {
		return workerSpec{}, errors.New("missing url: give ?url=http://host:port or a JSON body {\"url\":\"http://host:port\"}")
	}
	var spec workerSpec
	if err := json.Unmarshal(body, &spec); err != nil {
		return workerSpec{}, errors.New("invalid JSON body: " + err.Error())
	}
	if spec.URL == "" {
		return workerSpec{}, errors.New("missing url: the JSON body needs {\"url\":\"http://host:port\"}")
	}
	return spec, nil
}

// readBody reads a control request's body (at most maxBody bytes).
func readBody(r *http.Request) ([]byte, error) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	if err != nil {
		return nil, errors.New("cannot read the request body: " + err.Error())
	}
	if len(body) > maxBody {
		return nil, errors.New("request body too large")
	}
	return body, nil
}

// Answer is the JSON of a worker created or removed: the worker and a
// human-readable message (sglang-router's legacy answer was that text).
type Answer struct {
	registry.Info
	Message  string `json:"message"`
	Location string `json:"location,omitempty"`
}

func (s *Server) add(w http.ResponseWriter, r *http.Request) (registry.Info, bool) {
	spec, err := workerURL(r)
	var role registry.RoleSpec
	var given bool
	if err == nil {
		role, given, err = spec.role()
	}
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return registry.Info{}, false
	}
	if spec.KVEvents != "" || spec.KVEventsReplay != "" {
		if s.cfg.SetKVEvents == nil {
			writeError(w, http.StatusBadRequest, "kv_events: KV-event placement is off")
			return registry.Info{}, false
		}
		if err := s.cfg.SetKVEvents(spec.URL, spec.KVEvents, spec.KVEventsReplay); err != nil {
			if errors.Is(err, registry.ErrUnavailable) { // --cluster: etcd unreachable
				s.fail(w, err)
			} else {
				writeError(w, http.StatusBadRequest, err.Error())
			}
			return registry.Info{}, false
		}
	}
	if given {
		// Before the add: the worker takes its place with its role.
		if _, err := s.cfg.Registry.SetRole(spec.URL, role); err != nil {
			s.fail(w, err)
			return registry.Info{}, false
		}
	}
	if spec.MaxInFlight != nil {
		// Before the add: the worker routes with its capacity from the start.
		if _, err := s.cfg.Writer.SetCapacity(spec.URL, *spec.MaxInFlight); err != nil {
			s.fail(w, err)
			return registry.Info{}, false
		}
	}
	info, err := s.cfg.Writer.Add(r.Context(), spec.URL, registry.OriginAdmin)
	if spec.KVEvents != "" && info.URL != "" && info.URL != spec.URL {
		s.cfg.SetKVEvents(info.URL, spec.KVEvents, spec.KVEventsReplay) // the canonical URL
	}
	if errors.Is(err, registry.ErrDuplicate) {
		// An engine restarted on the same host:port registers again: the
		// routers this replaces treat that as a no-op, and clients call
		// raise_for_status() after registering.
		if cur, gerr := s.cfg.Registry.Get(spec.URL); gerr == nil {
			return cur, true
		}
	}
	if err != nil {
		s.fail(w, err)
		return registry.Info{}, false
	}
	return info, true
}

func (s *Server) legacyAdd(w http.ResponseWriter, r *http.Request) {
	if info, ok := s.add(w, r); ok {
		writeJSON(w, http.StatusOK, Answer{Info: info, Message: "Successfully added worker: " + info.URL})
	}
}

func (s *Server) create(w http.ResponseWriter, r *http.Request) {
	if info, ok := s.add(w, r); ok {
		loc := "/workers/" + info.WorkerID
		w.Header().Set("Location", loc)
		writeJSON(w, http.StatusOK, Answer{Info: info, Message: "Successfully added worker: " + info.URL, Location: loc})
	}
}

func (s *Server) legacyRemove(w http.ResponseWriter, r *http.Request) {
	spec, err := workerURL(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	u := spec.URL
	if _, _, err := registry.ParseURL(u); err != nil {
		s.fail(w, err)
		return
	}
	info, err := s.cfg.Writer.Remove(u)
	if err != nil {
		s.fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, Answer{Info: info, Message: "Successfully removed worker: " + info.URL})
}

func (s *Server) listURLs(w http.ResponseWriter, r *http.Request) {
	urls := s.cfg.Registry.URLs()
	if urls == nil {
		urls = []string{}
	}
	writeJSON(w, http.StatusOK, map[string]any{"urls": urls})
}

// List is the JSON of GET /workers.
type List struct {
	Workers []registry.Info `json:"workers"`
	Total   int             `json:"total"`   // workers in slots
	Healthy int             `json:"healthy"` // of which healthy
	Panic   bool            `json:"panic"`   // every routable worker unhealthy
}

func (s *Server) list(w http.ResponseWriter, r *http.Request) {
	out := List{Workers: s.cfg.Registry.List(), Panic: s.cfg.Registry.Panic()}
	if s.cfg.Decorate != nil {
		for i := range out.Workers {
			s.cfg.Decorate(&out.Workers[i])
		}
	}
	for _, in := range out.Workers {
		if in.State == registry.StatePending || in.State == registry.StateRemoved {
			continue
		}
		out.Total++
		if in.Healthy {
			out.Healthy++
		}
	}
	writeJSON(w, http.StatusOK, out)
}

// id returns the {id} path value (unescaped): a slot number or a worker
// url.
func id(r *http.Request) string { return r.PathValue("id") }

func (s *Server) get(w http.ResponseWriter, r *http.Request) {
	info, err := s.cfg.Registry.Get(id(r))
	if err != nil {
		s.fail(w, err)
		return
	}
	if s.cfg.Decorate != nil {
		s.cfg.Decorate(&info)
	}
	writeJSON(w, http.StatusOK, info)
}

func (s *Server) delete(w http.ResponseWriter, r *http.Request) {
	info, err := s.cfg.Writer.Remove(id(r))
	if err != nil {
		s.fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, Answer{Info: info, Message: "Successfully removed worker: " + info.URL})
}

// patch changes a worker's settings: {"max_in_flight":N}.
func (s *Server) patch(w http.ResponseWriter, r *http.Request) {
	info, err := s.cfg.Registry.Get(id(r))
	if err != nil {
		s.fail(w, err)
		return
	}
	body, err := readBody(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	var req struct {
		MaxInFlight *uint64 `json:"max_in_flight"`
	}
	dec := json.NewDecoder(strings.NewReader(string(body)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		writeError(w, http.StatusBadRequest, "invalid JSON body (want {\"max_in_flight\":N}): "+err.Error())
		return
	}
	if req.MaxInFlight == nil {
		writeError(w, http.StatusBadRequest, "nothing to change: want {\"max_in_flight\":N}")
		return
	}
	if _, err := s.cfg.Writer.SetCapacity(info.URL, *req.MaxInFlight); err != nil {
		s.fail(w, err)
		return
	}
	if info, err = s.cfg.Registry.Get(id(r)); err != nil {
		s.fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, info)
}

// routing answers the routing decision counts.
func (s *Server) routing(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Routing == nil {
		writeError(w, http.StatusNotFound, "routing counts not available")
		return
	}
	writeJSON(w, http.StatusOK, s.cfg.Routing())
}

// fleet answers the weight sync's state.
func (s *Server) fleet(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Fleet == nil {
		writeError(w, http.StatusNotFound, "fleet state not available")
		return
	}
	writeJSON(w, http.StatusOK, s.cfg.Fleet())
}

func (s *Server) cluster(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Cluster == nil {
		writeError(w, http.StatusNotFound, "not in cluster mode (--cluster)")
		return
	}
	writeJSON(w, http.StatusOK, s.cfg.Cluster())
}

func (s *Server) undrain(w http.ResponseWriter, r *http.Request) {
	info, err := s.cfg.Writer.Undrain(id(r))
	if err != nil {
		s.fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, info)
}

func (s *Server) drain(w http.ResponseWriter, r *http.Request) {
	info, err := s.cfg.Writer.Drain(id(r))
	if err != nil {
		s.fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, info)
}

// Load is one entry of /get_loads: sgl-model-gateway's shape, the load
// being tetherd's own count of requests in flight to the worker (the data
// port's fan-out lists the same entries).
type Load = engine.Load

// LoadsAnswer is /get_loads and /v1/loads: the list under "loads" (what
// sgl-model-gateway clients sum) and, as before, under "workers".
type LoadsAnswer struct {
	Loads        []Load `json:"loads"`
	Workers      []Load `json:"workers"`
	TotalWorkers int    `json:"total_workers"`
}

func (s *Server) loads(w http.ResponseWriter, r *http.Request) {
	out := LoadsAnswer{Loads: []Load{}}
	for _, in := range s.cfg.Registry.List() {
		if in.State == registry.StatePending || in.State == registry.StateRemoved {
			continue
		}
		out.Loads = append(out.Loads, Load{Worker: in.URL, WorkerType: "regular", Load: int64(in.InFlight)})
	}
	out.Workers, out.TotalWorkers = out.Loads, len(out.Loads)
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) metrics(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Metrics == nil {
		writeError(w, http.StatusNotFound, "metrics are not enabled")
		return
	}
	s.cfg.Metrics.ServeHTTP(w, r)
}

func (s *Server) health(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Health != nil {
		s.cfg.Health.ServeHTTP(w, r)
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}
