package registry

// Roles: a worker's part in a prefill/decode fleet (worker.Role), given
// with its URL (--prefill, --decode, POST /workers' worker_type and
// bootstrap_port) or learned from the engine later (SetRole). Like the
// capacity, a role is kept by URL, set before the add, and applied when
// the worker takes its slot.

import (
	"fmt"
	"net/url"
	"strconv"

	"github.com/tether-rl/tether/userspace/worker"
)

// RoleSpec is a worker's role as given.
type RoleSpec struct {
	Role          worker.Role
	BootstrapPort int // a prefill's (0: unknown)
}

// SplitBootstrapPort takes ?bootstrap_port=N off a worker URL (the form
// of --prefill URL): the URL without it, and N (0 if absent).
func SplitBootstrapPort(raw string) (string, int, error) {
	u, err := url.Parse(raw)
	if err != nil || u.RawQuery == "" {
		return raw, 0, nil // ParseURL says what is wrong, if anything
	}
	q := u.Query()
	v := q.Get("bootstrap_port")
	if v == "" {
		return raw, 0, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 || n > 65535 {
		return "", 0, fmt.Errorf("%w %q: bootstrap_port %q: want a port 1..65535", ErrBadURL, raw, v)
	}
	q.Del("bootstrap_port")
	u.RawQuery = q.Encode()
	return u.String(), n, nil
}

// SetRole records the role of the worker at rawURL (before or after its
// add) and applies it to the worker if it holds a slot. It returns the
// canonical URL.
func (r *Registry) SetRole(rawURL string, spec RoleSpec) (string, error) {
	canon, _, err := ParseURL(rawURL)
	if err != nil {
		return "", err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.roles[canon] = spec
	for _, e := range r.entries {
		if e.url == canon && e.w != nil {
			e.w.SetRole(spec.Role, spec.BootstrapPort)
		}
	}
	return canon, nil
}

// RoleOf returns the role given for url, and whether one was.
func (r *Registry) RoleOf(url string) (RoleSpec, bool) {
	canon, _, err := ParseURL(url)
	if err != nil {
		return RoleSpec{}, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	s, ok := r.roles[canon]
	return s, ok
}
