// Package workerclient is tetherd's one HTTP client to its workers, for
// the calls it makes on its own account (health checks, load polls,
// engine control fan-outs): one transport per user, never an environment
// proxy, the worker API key as a bearer token, answers read up to a bound,
// every call bounded in time. It carries dialect Calls; what they say is
// userspace/dialect's.
package workerclient

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/tether-rl/tether/userspace/dialect"
)

// Errors of Do, besides the transport's (wrapped).
var (
	ErrBadURL   = errors.New("bad worker url")
	ErrCutShort = errors.New("response cut short")
)

// Options configure a Client. The zero value of a field is its default.
type Options struct {
	// DialTimeout bounds a connect; default 5s.
	DialTimeout time.Duration
	// DialKeepAlive is the TCP keep-alive of its connections (0: Go's).
	DialKeepAlive time.Duration
	// Timeout, when set, bounds a whole call, answer headers included
	// (else the context alone bounds it).
	Timeout time.Duration
	// MaxIdlePerHost: idle connections kept per worker; 0: none, a fresh
	// connection for every call (a worker that went away is seen at once).
	MaxIdlePerHost int
	IdleTimeout    time.Duration // of an idle connection (0: Go's)
	// MaxHeaderBytes bounds an answer's headers (0: Go's default).
	MaxHeaderBytes int64
	// MaxBody bounds the answer bytes read (the rest is left); default
	// 64 KiB.
	MaxBody int64
	// DisableCompression: no Accept-Encoding: gzip.
	DisableCompression bool
	// FollowRedirects: a redirect is followed (else the 3xx is the answer).
	FollowRedirects bool
	// APIKey, when set, is sent as "Authorization: Bearer KEY" on a call
	// without an Authorization of its own.
	APIKey string
	// UserAgent, when set, is sent as User-Agent (else Go's).
	UserAgent string
}

// Client calls workers.
type Client struct {
	o  Options
	tr *http.Transport
	hc *http.Client
}

// New returns a client.
func New(o Options) *Client {
	if o.DialTimeout <= 0 {
		o.DialTimeout = 5 * time.Second
	}
	if o.MaxBody <= 0 {
		o.MaxBody = 64 << 10
	}
	tr := &http.Transport{
		Proxy:                  nil, // never an environment proxy: workers are direct
		DialContext:            (&net.Dialer{Timeout: o.DialTimeout, KeepAlive: o.DialKeepAlive}).DialContext,
		DisableKeepAlives:      o.MaxIdlePerHost <= 0,
		MaxIdleConnsPerHost:    max(o.MaxIdlePerHost, 0),
		IdleConnTimeout:        o.IdleTimeout,
		ResponseHeaderTimeout:  o.Timeout,
		MaxResponseHeaderBytes: o.MaxHeaderBytes,
		DisableCompression:     o.DisableCompression,
	}
	hc := &http.Client{Transport: tr, Timeout: o.Timeout}
	if !o.FollowRedirects {
		hc.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	}
	return &Client{o: o, tr: tr, hc: hc}
}

// Close releases idle connections.
func (c *Client) Close() { c.tr.CloseIdleConnections() }

// Answer is a worker's answer: its status and body (at most MaxBody
// bytes).
type Answer struct {
	Status     int
	StatusText string // "200 OK"
	Body       []byte
}

// OK reports a 2xx status.
func (a Answer) OK() bool { return a.Status >= 200 && a.Status <= 299 }

// Do makes call to the worker at base (its URL, joined to call.Path as
// is) with Authorization auth ("": the API key's bearer token, if any).
// A body goes as application/json. An error is the transport's (as
// net/http gives it, no answer), ErrBadURL, or ErrCutShort (the status is
// set).
func (c *Client) Do(ctx context.Context, base string, call dialect.Call, auth string) (Answer, error) {
	var body io.Reader
	if call.Body != nil {
		body = bytes.NewReader(call.Body)
	}
	req, err := http.NewRequestWithContext(ctx, call.Method, base+call.Path, body)
	if err != nil {
		return Answer{}, fmt.Errorf("%w: %w", ErrBadURL, err)
	}
	if call.Body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.o.UserAgent != "" {
		req.Header.Set("User-Agent", c.o.UserAgent)
	}
	if auth == "" && c.o.APIKey != "" {
		auth = "Bearer " + c.o.APIKey
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return Answer{}, err
	}
	defer resp.Body.Close()
	a := Answer{Status: resp.StatusCode, StatusText: resp.Status}
	a.Body, err = io.ReadAll(io.LimitReader(resp.Body, c.o.MaxBody))
	if err != nil {
		return a, fmt.Errorf("%w: %w", ErrCutShort, err)
	}
	return a, nil
}
