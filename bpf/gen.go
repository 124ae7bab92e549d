package bpf

// steer_bpfel.go/.o (the bpf_loop form) and steerbounded_bpfel.go/.o (the
// bounded-loop form, -DTETHER_BOUNDED) are generated from steer.c and
// committed, so that `go build` needs no clang. Regenerate (clang, libbpf-dev
// and the kernel UAPI headers installed) with `go generate ./bpf` or `make
// generate`.
//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -target bpfel -cc clang -cflags "-O2 -g -Wall -Werror -I/usr/include/x86_64-linux-gnu -I/usr/include/aarch64-linux-gnu" -type tether_slot -type tether_slot_load -type tether_worker_stats -type tether_sticky -type tether_decision steer steer.c
//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -target bpfel -cc clang -cflags "-O2 -g -Wall -Werror -I/usr/include/x86_64-linux-gnu -I/usr/include/aarch64-linux-gnu -DTETHER_BOUNDED" steerBounded steer.c
