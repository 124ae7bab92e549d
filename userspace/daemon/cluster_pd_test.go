package daemon

import (
	"fmt"
	"testing"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/etcdtest"
	"github.com/tether-rl/tether/testenv/fakepd"
	"github.com/tether-rl/tether/userspace/worker"
)

// TestClusterPDRoles: a prefill and a decode registered through one
// replica's admin API (worker_type, bootstrap_port, as slime sends them)
// carry their roles in the cluster table: the other replica has them in
// the same roles and serves P/D requests over them.
func TestClusterPDRoles(t *testing.T) {
	etcd := etcdtest.Start(t)
	ds := replicas(t, etcd, 2, Options{PDProtocol: PDSGLang})
	p, err := fakepd.StartSGLangPrefill(fakepd.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	d, err := fakepd.StartSGLangDecode(fakepd.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Kill)
	admin := "http://" + ds[0].AdminAddr() + "/workers"
	if r := ctlDo(t, "POST", admin, fmt.Sprintf(`{"url":%q,"worker_type":"prefill","bootstrap_port":%d}`, p.URL(), p.BootstrapPort())); r.status != 200 {
		t.Fatalf("add the prefill: %d %s", r.status, r.body)
	}
	if r := ctlDo(t, "POST", admin, fmt.Sprintf(`{"url":%q,"worker_type":"decode"}`, d.URL())); r.status != 200 {
		t.Fatalf("add the decode: %d %s", r.status, r.body)
	}
	b := ds[1]
	testenv.WaitFor(t, "the roles on the other replica", func() bool {
		var pre, dec bool
		for _, w := range b.Table.Snapshot() {
			if w == nil {
				continue
			}
			pre = pre || w.URL == p.URL() && w.Role() == worker.Prefill && w.BootstrapPort() == p.BootstrapPort()
			dec = dec || w.URL == d.URL() && w.Role() == worker.Decode
		}
		return pre && dec
	})
	r := ctlDo(t, "POST", "http://"+b.Addr()+"/generate", `{"text":"over the pair","sampling_params":{"max_new_tokens":3}}`)
	if r.status != 200 {
		t.Fatalf("through the other replica: %d %s", r.status, r.body)
	}
	if got, err := pdText("/generate", []byte(r.body)); err != nil || got != pdWant("/generate", "over the pair", 3) {
		t.Errorf("answer %q %v", got, err)
	}
}
