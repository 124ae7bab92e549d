package testenv

import (
	"io"
	"net"
	"testing"
)

// TestNetNSIsolated: a listener made inside a namespace is reachable from
// it and not from the test's own namespace.
func TestNetNSIsolated(t *testing.T) {
	ns := NewNetNS(t)
	var (
		ln  net.Listener
		err error
	)
	ns.Do(t, func() { ln, err = net.Listen("tcp", "127.0.0.1:0") })
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		if c, err := ln.Accept(); err == nil {
			c.Write([]byte("x"))
			c.Close()
		}
	}()
	c, err := ns.Dial(t, "tcp", ln.Addr().String())
	if err != nil {
		t.Fatalf("dial inside the namespace: %v", err)
	}
	b, _ := io.ReadAll(c)
	c.Close()
	if string(b) != "x" {
		t.Errorf("read %q", b)
	}
	if c, err := net.Dial("tcp", ln.Addr().String()); err == nil {
		c.Close()
		t.Error("namespace listener reachable from outside")
	}
}

// TestVeth: two namespaces joined by a veth pair talk over it.
func TestVeth(t *testing.T) {
	a, b := NewNetNS(t), NewNetNS(t)
	Veth(t, a, b, "10.199.0.1/24", "10.199.0.2/24")
	var (
		ln  net.Listener
		err error
	)
	b.Do(t, func() { ln, err = net.Listen("tcp", "10.199.0.2:0") })
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		if c, err := ln.Accept(); err == nil {
			io.Copy(c, c)
			c.Close()
		}
	}()
	c, err := a.Dial(t, "tcp", ln.Addr().String())
	if err != nil {
		t.Fatalf("dial over veth: %v", err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("echo over veth: %q %v", buf, err)
	}
}

func TestBPFFS(t *testing.T) {
	dir := BPFFS(t)
	if dir == "" {
		t.Fatal("no pin dir")
	}
}
