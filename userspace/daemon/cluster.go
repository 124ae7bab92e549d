package daemon

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/tether-rl/tether/userspace/cluster"
	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/sticky"
	"github.com/tether-rl/tether/userspace/worker"
)

// Cluster mode (--cluster etcd://...): the worker table lives in etcd and
// this tetherd is one replica of it (userspace/cluster, docs/cluster.md).

// DefaultClusterName is the key prefix's name without --cluster-name.
const DefaultClusterName = "default"

// startCluster connects to etcd, starts applying the cluster's table to
// the registry, and claims the start-up workers (--worker, --demo) in it.
// An unreachable etcd is no error: the replica says the link is down and
// the claims are retried in the background until it answers.
func (d *Daemon) startCluster(opts Options, workers []string) error {
	eps, err := cluster.ParseEndpoints(opts.Cluster)
	if err != nil {
		return err
	}
	name := opts.ClusterName
	if name == "" {
		name = DefaultClusterName
	}
	store, err := cluster.Dial(eps, name)
	if err != nil {
		return err
	}
	kvEndpoints, err := opts.Routing.KVEvents.workerEndpoints() // --worker-kv-events
	if err != nil {
		return err
	}
	d.ctl.store = store
	d.ctl.replica = cluster.NewReplica(store, d.Registry, d.log)
	d.ctl.replica.SetKVEventsHook(d.tableKVEvents())
	d.log.Info("cluster mode: the worker table is in etcd", "endpoints", eps, "name", name)
	if len(workers) > 0 {
		ctx, cancel := context.WithCancel(context.Background())
		d.ctl.claimStop = cancel
		d.ctl.claims.Add(1)
		go func() {
			defer d.ctl.claims.Done()
			d.claimStartup(ctx, store, workers, kvEndpoints)
		}()
	}
	return nil
}

// tableKVEvents is the replica's hook for the KV-event endpoints the
// table names (cluster.Spec.KVEvents): each is checked as the admin API's
// "kv_events" and set as the worker's own (endpoint "": dropped, back to
// --worker-kv-events or the template). A replica with KV-event placement
// off says so once, the first time an entry names an endpoint.
func (d *Daemon) tableKVEvents() func(url, endpoint, replay string) {
	var off sync.Once
	return func(url, endpoint, replay string) {
		if d.kv == nil {
			if endpoint != "" {
				off.Do(func() {
					d.log.Warn("cluster: the table names workers' own KV-event publishers (kv_events), but KV-event placement is off on this replica: not subscribing; start it with --kv-events, --kv-events-workers or --worker-kv-events as the other replicas",
						"url", url, "kv_events", endpoint)
				})
			}
			return
		}
		if endpoint != "" {
			err := checkKVEndpoint("kv_events", endpoint)
			if err == nil && replay != "" {
				err = checkKVEndpoint("kv_events_replay", replay)
			}
			if err != nil {
				d.log.Warn("cluster: a worker's kv_events in the table ignored", "url", url, "err", err)
				endpoint, replay = "", ""
			}
		}
		d.kv.set(url, endpoint, replay)
	}
}

// claimStartup claims each start-up worker's slot (one already claimed by
// another replica is kept), retrying while etcd is unreachable; a worker
// named by --worker-kv-events (kvEndpoints) claims it with its endpoints.
func (d *Daemon) claimStartup(ctx context.Context, store *cluster.Store, workers []string, kvEndpoints map[string][2]string) {
	left := append([]string(nil), workers...)
	for len(left) > 0 && ctx.Err() == nil {
		canon, _, err := registry.ParseURL(left[0])
		if err == nil {
			spec := cluster.Spec{URL: canon}
			if rs, ok := d.Registry.RoleOf(canon); ok && rs.Role != worker.Regular {
				spec.Role, spec.BootstrapPort = rs.Role.String(), rs.BootstrapPort
			}
			if e, ok := kvEndpoints[canon]; ok {
				spec.KVEvents, spec.KVEventsReplay = e[0], e[1]
			}
			_, err = store.Claim(ctx, spec, 0)
		}
		switch {
		case err == nil || errors.Is(err, cluster.ErrDuplicate):
			left = left[1:]
		case errors.Is(err, cluster.ErrUnavailable):
			select {
			case <-ctx.Done():
			case <-time.After(500 * time.Millisecond):
			}
		default:
			d.log.Error("cluster: start-up worker not claimed", "url", left[0], "err", err)
			left = left[1:]
		}
	}
}

// shareSessions returns the wrapper that shares the sticky table through
// etcd (--cluster-share-sessions), or nil.
func (d *Daemon) shareSessions(opts Options) func(sticky.Table) sticky.Table {
	if d.ctl.store == nil || !opts.ClusterShareSessions {
		return nil
	}
	return func(t sticky.Table) sticky.Table {
		d.ctl.shared = cluster.ShareSessions(d.ctl.store, t, d.log)
		return d.ctl.shared
	}
}

// fleetSync starts sharing the fleet's weight-sync state through etcd
// (cluster.FleetSync) and returns the engine's hook that writes this
// replica's changes (nil without --cluster). Called once the fleet holds
// what an upgrade handed over: until its first read of the fleet key, the
// fleet holds generation requests.
func (d *Daemon) fleetSync() func(fleet.State, bool) error {
	if d.ctl.store == nil {
		return nil
	}
	d.ctl.fleet = cluster.NewFleetSync(d.ctl.store, d.Fleet, d.InstanceID, d.log)
	d.ctl.fleet.Start()
	return d.ctl.fleet.Publish
}

func (d *Daemon) stopCluster() {
	if d.ctl.fleet != nil {
		d.ctl.fleet.Close()
	}
	if d.ctl.claimStop != nil {
		d.ctl.claimStop()
		d.ctl.claims.Wait()
	}
	if d.ctl.replica != nil {
		d.ctl.replica.Close()
	}
	if d.ctl.store != nil {
		d.ctl.store.Close()
	}
}

// ClusterStatus is the cluster link's state (nil without --cluster).
func (d *Daemon) ClusterStatus() *cluster.Status {
	if d.ctl.replica == nil {
		return nil
	}
	st := d.ctl.replica.Status()
	if d.ctl.fleet != nil {
		fs := d.ctl.fleet.Status()
		st.Fleet = &fs
	}
	return &st
}

// ClusterSynced is closed once this replica has applied its first list of
// etcd's table and watches it (nil without --cluster): tetherd tells
// systemd READY=1 only then, and admin writes wait for it (bounded).
func (d *Daemon) ClusterSynced() <-chan struct{} {
	if d.ctl.replica == nil {
		return nil
	}
	return d.ctl.replica.Synced()
}

func checkCluster(o *Options) error {
	if o.Cluster == "" {
		switch {
		case o.ClusterName != "":
			return errors.New("--cluster-name without --cluster")
		case o.ClusterShareSessions:
			return errors.New("--cluster-share-sessions without --cluster")
		}
		return nil
	}
	if _, err := cluster.ParseEndpoints(o.Cluster); err != nil {
		return err
	}
	if o.ClusterName != "" {
		if err := cluster.ValidName(o.ClusterName); err != nil {
			return err
		}
	}
	if o.ClusterShareSessions && o.Cluster == "" {
		return errors.New("--cluster-share-sessions without --cluster")
	}
	if o.Spawn.N > 0 {
		return fmt.Errorf("--spawn and --cluster: spawned workers are local to one host; register them with 'tetherctl workers register' instead")
	}
	return nil
}
