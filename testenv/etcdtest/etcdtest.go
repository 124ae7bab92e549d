// Package etcdtest runs a real etcd member in-process (etcd's embed
// package) on loopback for the cluster tests: no mock of the client.
package etcdtest

import (
	"fmt"
	"net"
	"net/url"
	"testing"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// Etcd is a single-member etcd cluster on loopback.
type Etcd struct {
	t      testing.TB
	dir    string
	client string // client URL
	peer   string
	e      *embed.Etcd
}

func freePort(t testing.TB) int {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// Start starts a member in a temporary directory; it stops when the test
// ends.
func Start(t testing.TB) *Etcd {
	t.Helper()
	e := &Etcd{t: t, dir: t.TempDir(),
		client: fmt.Sprintf("http://127.0.0.1:%d", freePort(t)),
		peer:   fmt.Sprintf("http://127.0.0.1:%d", freePort(t))}
	e.start()
	t.Cleanup(e.Stop)
	return e
}

func (e *Etcd) start() {
	e.t.Helper()
	cfg := embed.NewConfig()
	cfg.Dir = e.dir
	cfg.Name = "tether-test"
	cu, _ := url.Parse(e.client)
	pu, _ := url.Parse(e.peer)
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*cu}, []url.URL{*cu}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*pu}, []url.URL{*pu}
	cfg.InitialCluster = cfg.Name + "=" + e.peer
	cfg.Logger = "zap"
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	m, err := embed.StartEtcd(cfg)
	if err != nil {
		e.t.Fatalf("etcd: %v", err)
	}
	select {
	case <-m.Server.ReadyNotify():
	case <-time.After(30 * time.Second):
		m.Close()
		e.t.Fatal("etcd did not become ready in 30s")
	}
	e.e = m
}

// Endpoint is the member's client address, host:port.
func (e *Etcd) Endpoint() string { u, _ := url.Parse(e.client); return u.Host }

// Stop stops the member (its data stays for Restart).
func (e *Etcd) Stop() {
	if e.e != nil {
		e.e.Close()
		e.e = nil
	}
}

// Restart starts the member again on the same data and ports.
func (e *Etcd) Restart() {
	e.t.Helper()
	e.Stop()
	e.start()
}
