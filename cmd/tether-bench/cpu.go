package main

import (
	"os"
	"strconv"
	"strings"
)

// clockTicks is USER_HZ, the unit of the utime/stime fields of
// /proc/PID/stat: 100 on every Linux architecture Go supports here.
const clockTicks = 100

type statFields struct {
	ppid                         int
	utime, stime, cutime, cstime int64
}

func readStat(pid int) (statFields, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return statFields{}, false
	}
	s := string(b)
	// comm may contain spaces and parentheses: fields start after the last ')'.
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return statFields{}, false
	}
	f := strings.Fields(s[i+1:])
	// f[0] is field 3 (state), so field N is f[N-3].
	if len(f) < 15 {
		return statFields{}, false
	}
	atoi := func(x string) int64 { v, _ := strconv.ParseInt(x, 10, 64); return v }
	return statFields{
		ppid:   int(atoi(f[1])),
		utime:  atoi(f[11]), // field 14
		stime:  atoi(f[12]), // field 15
		cutime: atoi(f[13]), // field 16
		cstime: atoi(f[14]), // field 17
	}, true
}

// treeTicks returns the CPU ticks (user+system) used so far by the given
// processes and all their descendants (found through the ppid field of
// /proc/*/stat). The reaped-children fields are included so a child that
// exits between two samples does not make its time vanish.
func treeTicks(roots ...int) int64 {
	ents, _ := os.ReadDir("/proc")
	children := map[int][]int{}
	stats := map[int]statFields{}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		st, ok := readStat(pid)
		if !ok {
			continue
		}
		stats[pid] = st
		children[st.ppid] = append(children[st.ppid], pid)
	}
	var total int64
	seen := map[int]bool{}
	queue := append([]int(nil), roots...)
	for len(queue) > 0 {
		pid := queue[0]
		queue = queue[1:]
		if seen[pid] {
			continue
		}
		seen[pid] = true
		if st, ok := stats[pid]; ok {
			total += st.utime + st.stime + st.cutime + st.cstime
		}
		queue = append(queue, children[pid]...)
	}
	return total
}

// ticksToSeconds converts clock ticks to CPU seconds.
func ticksToSeconds(t int64) float64 { return float64(t) / clockTicks }
