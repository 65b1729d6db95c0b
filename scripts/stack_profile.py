#!/usr/bin/env python3
"""A poor man's profile: where each thread of a process was, over stack samples taken by
attaching gdb (or cuda-gdb, on hosts without perf) with `thread apply all bt`.

    scripts/stack_profile.py SAMPLE_FILE... [--top N]

Each file is one sample: gdb's output for every thread. A thread's sample is *waiting* when one
of its innermost frames blocks (futex, condition variable, park, sleep, poll); the others are
*busy* (a thread spinning on CubeCL's full task queue, with `submit_inner`, `launch_inner` or
`do_empty` innermost, is busy waiting for the thread it feeds). For each thread with busy samples it prints the functions found in its busy stacks by
share of them (inclusive: a function counts once per sample wherever it sits in the stack), then
the innermost frames (where the time was spent itself). Rust's symbol hashes are dropped.
"""

import argparse
import collections
import re
import sys

THREAD = re.compile(r'^Thread \d+ \(Thread 0x[0-9a-f]+ \(LWP (\d+)\) "([^"]*)"\):')
FRAME = re.compile(r'^#(\d+)\s+(?:0x[0-9a-f]+ in )?(.+?)(?: \(.*\))?(?: (?:at|from) \S+)?$')
HASH = re.compile(r'::h[0-9a-f]{16}')
CRATE_HASH = re.compile(r'\[[0-9a-f]{16}\]')
WAITING = re.compile(
    r'futex|pthread_cond_|Condvar.*wait|thread::functions::park|::park\b|clock_nanosleep|'
    r'nanosleep|thread::functions::sleep|epoll_wait|\bpoll\b|__GI___poll|sem_wait|'
    r'sleep::Sleep::sleep|wait_until_cold|sched_yield'
)
# Frames every stack of a thread holds: left out of the inclusive list.
BOILERPLATE = re.compile(
    r'^(clone3|start_thread|main|\?\?)$|thread_start|__rust_begin_short_backtrace|call_once|lang_start|'
    r'LocalKey<T>::with|try_fold|try_process|__libc_start'
)
# How deep a waiting frame may sit (syscall wrappers above it).
WAIT_DEPTH = 4


def frame_name(text):
    """The function of one gdb frame line's text, without symbol hashes and argument lists."""
    name = CRATE_HASH.sub('', HASH.sub('', text)).strip()
    return name


def parse(path):
    """[(lwp, thread name, [innermost .. outermost function])] of one sample file."""
    threads, current = [], None
    with open(path, errors='replace') as f:
        for line in f:
            line = line.rstrip('\n')
            m = THREAD.match(line)
            if m:
                current = (m.group(1), m.group(2), [])
                threads.append(current)
                continue
            if current is None:
                continue
            m = FRAME.match(line)
            if m:
                current[2].append(frame_name(m.group(2)))
    return threads


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('samples', nargs='+')
    parser.add_argument('--top', type=int, default=25)
    args = parser.parse_args()

    busy = collections.defaultdict(list)
    seen = collections.Counter()
    for path in args.samples:
        for lwp, name, frames in parse(path):
            key = f'{name} (LWP {lwp})'
            seen[key] += 1
            if not frames or any(WAITING.search(f) for f in frames[:WAIT_DEPTH]):
                continue
            busy[key].append(frames)

    print(f'{len(args.samples)} samples; busy share per thread (the rest waiting):')
    for key, n in sorted(seen.items(), key=lambda kv: -len(busy[kv[0]])):
        print(f'  {len(busy[key]):4d} / {n:4d}  {key}')
    for key, stacks in sorted(busy.items(), key=lambda kv: -len(kv[1])):
        if len(stacks) < 2:
            continue
        inclusive = collections.Counter()
        innermost = collections.Counter()
        for frames in stacks:
            inclusive.update({f for f in frames if not BOILERPLATE.search(f)})
            innermost[frames[0]] += 1
        print(f'\n== {key}: {len(stacks)} busy samples')
        print('  inclusive (share of busy samples whose stack holds the function):')
        for function, count in inclusive.most_common(args.top):
            print(f'    {100 * count / len(stacks):5.1f}%  {function[:150]}')
        print('  innermost frame:')
        for function, count in innermost.most_common(min(args.top, 12)):
            print(f'    {100 * count / len(stacks):5.1f}%  {function[:150]}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
