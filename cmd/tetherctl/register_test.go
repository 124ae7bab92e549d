package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/etcdtest"
	"github.com/tether-rl/tether/userspace/cluster"
)

// workers register keeps the worker in the cluster's table while it runs
// and takes it out when stopped; bad arguments are refused.
func TestWorkersRegister(t *testing.T) {
	etcd := etcdtest.Start(t)
	ep := "etcd://" + etcd.Endpoint()
	for _, args := range [][]string{
		{"http://127.0.0.1:9"},
		{"--cluster", "http://x:1", "http://127.0.0.1:9"},
		{"--cluster", ep},
		{"--cluster", ep, "--lease", "100ms", "http://127.0.0.1:9"},
		{"--cluster", ep, "ftp://x"},
	} {
		if err := register(context.Background(), args, &testenv.Buffer{}); err == nil {
			t.Errorf("%v accepted", args)
		}
	}
	store, err := cluster.Dial([]string{"http://" + etcd.Endpoint()}, "rl")
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	count := func() int {
		tab, err := store.Load(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return len(tab.Workers)
	}
	ctx, cancel := context.WithCancel(context.Background())
	out := &testenv.Buffer{}
	done := make(chan error, 1)
	go func() {
		done <- register(ctx, []string{"--cluster", ep, "--cluster-name", "rl", "--lease", "2s", "http://127.0.0.1:30001"}, out)
	}()
	testenv.WaitFor(t, "the registration", func() bool { return strings.Contains(out.String(), "registered") })
	if n := count(); n != 1 {
		t.Fatalf("%d workers in the table, want 1", n)
	}
	time.Sleep(3 * time.Second) // past the lease: renewed
	if n := count(); n != 1 {
		t.Fatal("the renewed registration left the table")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := count(); n != 0 {
		t.Fatalf("%d workers after the registrant stopped", n)
	}
}

// tetherctl status says whether the cluster link is up, and why not.
func TestStatusCluster(t *testing.T) {
	var b strings.Builder
	st := &Status{Cluster: &cluster.Status{Name: "/tether/rl/", Up: false, LastError: "cluster store (etcd) unavailable: context deadline exceeded", Workers: 3, Revision: 42}}
	if err := st.printCluster(&b); err != nil {
		t.Fatal(err)
	}
	if out := b.String(); !strings.Contains(out, "link DOWN") || !strings.Contains(out, "503") || !strings.Contains(out, "3 workers at revision 42") {
		t.Fatalf("status: %q", out)
	}
	b.Reset()
	st.Cluster.Up = true
	st.printCluster(&b)
	if !strings.Contains(b.String(), "link UP") {
		t.Fatalf("status: %q", b.String())
	}
}
