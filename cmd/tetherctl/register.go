package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/tether-rl/tether/userspace/cluster"
)

// cmdRegister keeps a worker in a cluster's table on an etcd lease until
// it is stopped (SIGINT, SIGTERM: the lease is revoked and the worker
// leaves every replica's table at once) or dies (the lease expires after
// --lease). Run it beside the worker, e.g. as its unit's ExecStartPost.
func cmdRegister(args []string, stdout io.Writer) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return register(ctx, args, stdout)
}

type registerOpts struct {
	endpoints, name *string
	lease           *time.Duration
}

func addRegisterFlags(fs *flag.FlagSet) registerOpts {
	return registerOpts{
		endpoints: fs.String("cluster", "", "etcd://HOST:PORT[,HOST:PORT...] (as tetherd's --cluster; HOST:PORT and http://HOST:PORT too)"),
		name:      fs.String("cluster-name", "default", "the cluster's name (as tetherd's --cluster-name)"),
		lease:     fs.Duration("lease", 10*time.Second, "lease TTL: a worker whose registrant dies leaves the table after this long"),
	}
}

// register is cmdRegister until ctx ends.
func register(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("workers register", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	o := addRegisterFlags(fs)
	endpoints, name, lease := o.endpoints, o.name, o.lease
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usagef("workers register wants one argument: the worker's URL")
	}
	if *endpoints == "" {
		return usagef("workers register needs --cluster etcd://HOST:PORT")
	}
	ep, err := etcdEndpoints(*endpoints)
	if err != nil {
		return err
	}
	eps, err := cluster.ParseEndpoints(ep)
	if err != nil {
		return usagef("%v", err)
	}
	store, err := cluster.Dial(eps, *name)
	if err != nil {
		return err
	}
	defer store.Close()
	slot, done, err := cluster.Register(ctx, store, pos[0], *lease)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "registered %s in slot %d of cluster %s (lease %v); stop with Ctrl-C or SIGTERM\n", pos[0], slot, *name, *lease)
	if err := <-done; err != nil {
		return fmt.Errorf("registration of %s ended: %w", pos[0], err)
	}
	fmt.Fprintf(stdout, "unregistered %s\n", pos[0])
	return nil
}
