package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"text/tabwriter"
	"time"
)

// DefaultAdmin is tetherd's default admin API (tetherd --admin).
const DefaultAdmin = "http://127.0.0.1:8081"

const workersUsage = "workers list|add URL|remove ID|drain ID|undrain ID [--admin HOST:PORT] [--token T] [--json]\n" +
	"          workers register URL --cluster etcd://HOST:PORT [--cluster-name N] [--lease 10s]  keep URL in a cluster's table while this runs"

// adminOpts are the flags of the verbs that call the admin API.
type adminOpts struct {
	admin, token *string
	asJSON       *bool
	timeout      *time.Duration
}

func addAdminFlags(fs *flag.FlagSet) adminOpts {
	return adminOpts{
		admin:   fs.String("admin", DefaultAdmin, "tetherd's admin API: HOST:PORT (as tetherd's --admin) or http://HOST:PORT"),
		token:   fs.String("token", "", "admin token (default: $TETHER_ADMIN_TOKEN)"),
		asJSON:  fs.Bool("json", false, "print the API's JSON answer"),
		timeout: fs.Duration("timeout", 6*time.Minute, "give up after this long (add waits for the worker's health)"),
	}
}

// workersFlags is every workers subcommand's flags on one set: it tells
// which flags take a value, to find the subcommand among them.
func workersFlags() *flag.FlagSet {
	fs := flag.NewFlagSet("workers", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	addAdminFlags(fs)
	addRegisterFlags(fs)
	return fs
}

// newAdminClient returns the client of the admin API at addr (HOST:PORT or
// a URL), with the token (default: $TETHER_ADMIN_TOKEN).
func newAdminClient(addr, token string, timeout time.Duration) (*adminClient, error) {
	base, err := adminURL(addr)
	if err != nil {
		return nil, err
	}
	if token == "" {
		token = os.Getenv("TETHER_ADMIN_TOKEN")
	}
	return &adminClient{base: base, token: token, http: &http.Client{Timeout: timeout}}, nil
}

// cmdWorkers manages tetherd's workers over its admin API:
//
//	tetherctl workers list              slot, state, health, load, url
//	tetherctl workers add URL           returns once URL is healthy and routes
//	tetherctl workers remove ID         ID: slot number or url
//	tetherctl workers drain ID          no new sessions; existing ones go on
//	tetherctl workers undrain ID        routable again
//
// Flags go before or after the subcommand.
func cmdWorkers(args []string, stdout io.Writer) error {
	const want = "list, add, remove, drain, undrain or register"
	i := firstArg(args, valueIn(workersFlags()))
	if i < 0 {
		return usagef("want a subcommand: %s", want)
	}
	sub, rest := args[i], without(args, i)
	if sub == "register" {
		return cmdRegister(rest, stdout)
	}
	fs := flag.NewFlagSet("workers "+sub, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	o := addAdminFlags(fs)
	pos, err := parse(fs, rest)
	if err != nil {
		return err
	}
	c, err := newAdminClient(*o.admin, *o.token, *o.timeout)
	if err != nil {
		return err
	}
	one := func() (string, error) {
		if len(pos) != 1 {
			return "", usagef("workers %s wants one argument", sub)
		}
		return pos[0], nil
	}
	// post calls a worker's action (drain, undrain) and prints its answer.
	post := func(action, done string) error {
		id, err := one()
		if err != nil {
			return err
		}
		body, err := c.do("POST", "/workers/"+url.PathEscape(id)+"/"+action, nil)
		if err != nil {
			return err
		}
		return printOne(stdout, body, *o.asJSON, done)
	}
	switch sub {
	case "list", "ls":
		if len(pos) != 0 {
			return usagef("workers list takes no argument")
		}
		body, err := c.do("GET", "/workers", nil)
		if err != nil {
			return err
		}
		if *o.asJSON {
			_, err := stdout.Write(body)
			return err
		}
		return printWorkers(stdout, body)
	case "add":
		u, err := one()
		if err != nil {
			return err
		}
		req, _ := json.Marshal(map[string]string{"url": u})
		body, err := c.do("POST", "/workers", req)
		if err != nil {
			return err
		}
		return printOne(stdout, body, *o.asJSON, "added")
	case "remove", "rm":
		id, err := one()
		if err != nil {
			return err
		}
		body, err := c.do("DELETE", "/workers/"+url.PathEscape(id), nil)
		if err != nil {
			return err
		}
		return printOne(stdout, body, *o.asJSON, "removed")
	case "drain":
		return post("drain", "draining")
	case "undrain":
		return post("undrain", "undrained")
	}
	return usagef("unknown subcommand %q: want %s", sub, want)
}

type adminClient struct {
	base  string
	token string
	http  *http.Client
}

// do calls the admin API and returns the body of a 2xx answer; any other
// answer is an error carrying the API's message.
func (c *adminClient) do(method, path string, body []byte) ([]byte, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequest(method, c.base+path, rd)
	if err != nil {
		return nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("admin API: %w", err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, fmt.Errorf("admin API: %w", err)
	}
	if resp.StatusCode/100 != 2 {
		var e struct {
			Error struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if json.Unmarshal(out, &e) == nil && e.Error.Message != "" {
			return nil, &httpError{code: resp.StatusCode, msg: fmt.Sprintf("%s (HTTP %d)", e.Error.Message, resp.StatusCode)}
		}
		return nil, &httpError{code: resp.StatusCode, msg: "admin API: " + resp.Status}
	}
	return out, nil
}

// httpError is an admin API answer other than 2xx.
type httpError struct {
	code int
	msg  string
}

func (e *httpError) Error() string { return e.msg }

type workerJSON struct {
	WorkerID  string `json:"worker_id"`
	Slot      int    `json:"slot"`
	URL       string `json:"url"`
	State     string `json:"state"`
	Healthy   bool   `json:"healthy"`
	Origin    string `json:"origin"`
	InFlight  uint64 `json:"in_flight"`
	Requests  uint64 `json:"requests"`
	Errors    uint64 `json:"errors"`
	LastError string `json:"last_error"`
}

func printWorkers(w io.Writer, body []byte) error {
	var l struct {
		Workers []workerJSON `json:"workers"`
		Total   int          `json:"total"`
		Healthy int          `json:"healthy"`
		Panic   bool         `json:"panic"`
	}
	if err := json.Unmarshal(body, &l); err != nil {
		return fmt.Errorf("admin API: bad answer: %w", err)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SLOT\tSTATE\tHEALTHY\tIN FLIGHT\tREQUESTS\tERRORS\tORIGIN\tURL")
	for _, x := range l.Workers {
		fmt.Fprintf(tw, "%d\t%s\t%t\t%d\t%d\t%d\t%s\t%s\n", x.Slot, x.State, x.Healthy, x.InFlight, x.Requests, x.Errors, x.Origin, x.URL)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(w, "%d workers, %d healthy", l.Total, l.Healthy)
	if l.Panic {
		fmt.Fprint(w, " (PANIC: every worker unhealthy, routing to all of them)")
	}
	fmt.Fprintln(w)
	return nil
}

func printOne(w io.Writer, body []byte, raw bool, verb string) error {
	if raw {
		_, err := w.Write(body)
		return err
	}
	var x workerJSON
	if err := json.Unmarshal(body, &x); err != nil {
		return errors.New("admin API: bad answer")
	}
	fmt.Fprintf(w, "%s: slot %d %s (%s)\n", verb, x.Slot, x.URL, x.State)
	return nil
}
