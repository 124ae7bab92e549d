// Worker URLs: parsing to a canonical form and the address to dial, one
// engine under two names (aliases), and tetherd's own endpoints refused
// as workers.

package registry

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"
)

// ParseURL checks a worker URL (http://host:port, no path, query or
// credentials) and returns its canonical form (no trailing slash, lower
// case scheme and host) and the address to dial. https is refused: tether
// speaks plain HTTP/1.1 upstream.
func ParseURL(raw string) (canon, addr string, err error) {
	if strings.TrimSpace(raw) == "" {
		return "", "", fmt.Errorf("%w: missing url", ErrBadURL)
	}
	if i := strings.Index(raw, "://"); i >= 0 && strings.Contains(raw[i+3:], "@") {
		return "", "", fmt.Errorf("%w %q: data-parallel rank URLs (url@rank) are not supported: register the engine's base URL http://host:port once (the engine spreads over its own ranks)", ErrBadURL, raw)
	}
	u, err := url.Parse(raw)
	if err != nil {
		return "", "", fmt.Errorf("%w %q: %v", ErrBadURL, raw, err)
	}
	switch strings.ToLower(u.Scheme) {
	case "http":
	case "https":
		return "", "", fmt.Errorf("%w %q: https backends are not supported (tether speaks plain HTTP/1.1 upstream)", ErrBadURL, raw)
	default:
		return "", "", fmt.Errorf("%w %q: scheme must be http", ErrBadURL, raw)
	}
	if u.Host == "" || u.User != nil || (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "" {
		return "", "", fmt.Errorf("%w %q: want http://host:port", ErrBadURL, raw)
	}
	host, port := strings.ToLower(u.Hostname()), u.Port()
	if host == "" {
		return "", "", fmt.Errorf("%w %q: want http://host:port", ErrBadURL, raw)
	}
	if port == "" {
		port = "80"
	} else if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return "", "", fmt.Errorf("%w %q: bad port", ErrBadURL, raw)
	}
	addr = net.JoinHostPort(host, port)
	canon = "http://" + strings.ToLower(u.Host)
	return canon, addr, nil
}

// findLocked returns the entry whose canonical url or address is addr.
// findAddrLocked returns the entry at addr, or at an alias of it (a host
// name and the address it resolves to, localhost and 127.0.0.1: one
// engine, one slot).
func (r *Registry) findAddrLocked(addr string) *entry {
	for _, e := range r.entries {
		if e.addr == addr {
			return e
		}
	}
	keys := endpointKeys(addr)
	for _, e := range r.entries {
		if e.keys == nil || e.keysOf != e.addr {
			e.keys, e.keysOf = endpointKeys(e.addr), e.addr // resolved once per address
		}
		for _, k := range e.keys {
			if slices.Contains(keys, k) {
				return e
			}
		}
	}
	return nil
}

// AddSelf adds endpoints of tetherd's own (a listener bound after the
// registry was made) to Options.Self.
func (r *Registry) AddSelf(endpoints ...string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.opts.Self = append(slices.Clone(r.opts.Self), endpoints...)
}

// notSelf refuses a worker address that is tetherd itself.
func (r *Registry) notSelf(canon, addr string) error {
	r.mu.Lock()
	self := r.opts.Self
	r.mu.Unlock()
	if len(self) == 0 {
		return nil
	}
	for _, k := range endpointKeys(addr) {
		if slices.Contains(self, k) {
			return fmt.Errorf("%w %q: that is tetherd itself (%s), not a worker", ErrBadURL, canon, k)
		}
	}
	return nil
}

// endpointKeys returns the ip:port endpoints addr names: itself for an IP
// address, else those its host resolves to (at most a few; none when it
// does not resolve).
func endpointKeys(addr string) []string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil
	}
	if ip := net.ParseIP(host); ip != nil {
		return []string{net.JoinHostPort(ip.String(), port)}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	ips, err := net.DefaultResolver.LookupHost(ctx, host)
	if err != nil {
		return nil
	}
	out := make([]string, 0, len(ips))
	for _, ip := range ips {
		if p := net.ParseIP(ip); p != nil {
			out = append(out, net.JoinHostPort(p.String(), port))
		}
	}
	return out
}
