//! Reading how much memory exists, is used and is free — and giving it back.
//!
//! The host probe reads Linux directly: `/proc/meminfo` (MemAvailable), the memory
//! cgroup of this process (v2 `memory.max` / `memory.current`, v1
//! `memory.limit_in_bytes` / `memory.usage_in_bytes`, both minus the unmapped page
//! cache, which the kernel reclaims before it OOM-kills) and the process RSS.

use std::{fs, path::PathBuf};

/// One reading of a device's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct MemorySnapshot {
    /// What the process may use in all: the cgroup limit, else the machine's RAM.
    pub total_bytes: u64,
    /// What can still be allocated before the limit (or before the machine runs out).
    pub available_bytes: u64,
    /// Resident set of this process.
    pub process_bytes: u64,
    /// Where `total_bytes` came from.
    pub source: LimitSource,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LimitSource {
    #[default]
    Machine,
    CgroupV1,
    CgroupV2,
}

/// Anything that can say how much memory there is.
pub trait MemoryProbe: Send + Sync {
    fn snapshot(&self) -> MemorySnapshot;
    /// Bytes this process holds now, for measuring what a load took (`None`: unknown).
    fn process_bytes(&self) -> Option<u64> {
        None
    }
    /// Starts a new peak measurement.
    fn reset_peak(&self) {}
    /// The most this process held since `reset_peak`.
    fn peak_process_bytes(&self) -> Option<u64> {
        None
    }
}

/// The Linux host probe.
#[derive(Debug, Clone)]
pub struct HostProbe {
    cgroup: Option<Cgroup>,
}

#[derive(Debug, Clone)]
enum Cgroup {
    V1(PathBuf),
    V2(PathBuf),
}

impl Default for HostProbe {
    fn default() -> Self {
        HostProbe::new()
    }
}

impl HostProbe {
    /// Finds this process's memory cgroup (v2 first, then v1).
    pub fn new() -> HostProbe {
        HostProbe { cgroup: find_cgroup("/proc/self/cgroup", "/sys/fs/cgroup") }
    }

    fn cgroup_reading(&self) -> Option<(u64, u64, LimitSource)> {
        let (limit, usage, stat, source) = match self.cgroup.as_ref()? {
            Cgroup::V2(dir) => (
                read_trim(dir.join("memory.max"))?,
                read_trim(dir.join("memory.current"))?,
                fs::read_to_string(dir.join("memory.stat")).ok(),
                LimitSource::CgroupV2,
            ),
            Cgroup::V1(dir) => (
                read_trim(dir.join("memory.limit_in_bytes"))?,
                read_trim(dir.join("memory.usage_in_bytes"))?,
                fs::read_to_string(dir.join("memory.stat")).ok(),
                LimitSource::CgroupV1,
            ),
        };
        // "max" (v2) or a huge number (v1: PAGE_COUNTER_MAX) means no limit.
        let limit: u64 = limit.parse().ok()?;
        if limit >= 1 << 60 {
            return None;
        }
        let usage: u64 = usage.parse().ok()?;
        let reclaimable = stat.as_deref().map_or(0, reclaimable_cache);
        Some((limit, usage.saturating_sub(reclaimable), source))
    }
}

impl MemoryProbe for HostProbe {
    fn snapshot(&self) -> MemorySnapshot {
        let meminfo = fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let mem_total = meminfo_kib(&meminfo, "MemTotal").unwrap_or(0) * 1024;
        let mem_available = meminfo_kib(&meminfo, "MemAvailable").unwrap_or(0) * 1024;
        let process_bytes = process_rss_bytes();
        match self.cgroup_reading() {
            Some((limit, usage, source)) if limit < mem_total || mem_total == 0 => MemorySnapshot {
                total_bytes: limit,
                available_bytes: limit.saturating_sub(usage).min(mem_available.max(1)),
                process_bytes,
                source,
            },
            _ => MemorySnapshot {
                total_bytes: mem_total,
                available_bytes: mem_available,
                process_bytes,
                source: LimitSource::Machine,
            },
        }
    }

    fn process_bytes(&self) -> Option<u64> {
        Some(process_rss_bytes())
    }

    fn reset_peak(&self) {
        let _ = reset_peak_rss();
    }

    fn peak_process_bytes(&self) -> Option<u64> {
        peak_rss_bytes()
    }
}

/// Page cache the kernel drops before it OOM-kills: inactive *and* active file pages
/// not mapped by a process. Only counting `inactive_file` made the probe report a
/// cgroup as full after a few models had been read from disk (their files sit in
/// `active_file`), refusing loads the kernel would have made room for.
fn reclaimable_cache(stat: &str) -> u64 {
    // cgroup v1 has hierarchical `total_*` keys; v2 and v1 leaves have the plain ones.
    let field =
        |k: &str| stat_field(stat, &format!("total_{k}")).or_else(|| stat_field(stat, k)).unwrap_or(0);
    let mapped = stat_field(stat, "file_mapped").unwrap_or_else(|| field("mapped_file"));
    (field("inactive_file") + field("active_file")).saturating_sub(mapped)
}

fn read_trim(path: PathBuf) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

fn find_cgroup(proc_cgroup: &str, root: &str) -> Option<Cgroup> {
    let text = fs::read_to_string(proc_cgroup).ok()?;
    parse_proc_cgroup(&text, root)
}

/// Picks the memory cgroup directory out of `/proc/self/cgroup`.
fn parse_proc_cgroup(text: &str, root: &str) -> Option<Cgroup> {
    let mut v2 = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let rel = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "memory") {
            let dir = PathBuf::from(root).join("memory").join(rel);
            if dir.join("memory.limit_in_bytes").exists() {
                return Some(Cgroup::V1(dir));
            }
        } else if controllers.is_empty() {
            let dir = PathBuf::from(root).join(rel);
            if dir.join("memory.max").exists() {
                v2 = Some(Cgroup::V2(dir));
            }
        }
    }
    v2
}

fn meminfo_kib(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
}

fn stat_field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next()? == key).then(|| it.next()?.parse().ok())?
    })
}

/// `/proc/self/statm`'s resident and shared sizes, in bytes.
pub(crate) fn statm_resident_shared() -> (u64, u64) {
    let statm = fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let mut fields = statm.split_whitespace().skip(1).map(|p| p.parse::<u64>().unwrap_or(0));
    let (resident, shared) = (fields.next().unwrap_or(0), fields.next().unwrap_or(0));
    // SAFETY: sysconf has no preconditions.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    (resident * page, shared * page)
}

/// Resident set size of this process, from `/proc/self/statm`.
pub fn process_rss_bytes() -> u64 {
    statm_resident_shared().0
}

/// Private resident memory of this process — anonymous pages (heaps, ONNX Runtime's
/// arenas), without file pages (mapped weights) — from `/proc/self/statm`: resident
/// less shared.
pub fn process_private_bytes() -> u64 {
    let (resident, shared) = statm_resident_shared();
    resident.saturating_sub(shared)
}

/// Resets the process's high-water mark (VmHWM) so a load's peak can be read after it.
pub fn reset_peak_rss() -> bool {
    // "5" resets the peak RSS (Linux >= 4.0); where that is not allowed, the peak
    // reading below is simply the lifetime peak and is discarded as not measured.
    fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The process's peak RSS since the last [`reset_peak_rss`], from `/proc/self/status`.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    meminfo_kib(&status, "VmHWM").map(|k| k * 1024)
}

/// Low-RAM allocator tuning: one malloc arena (threads otherwise each get their own,
/// each keeping freed memory) and a 64 KiB mmap threshold (larger blocks go straight
/// to mmap and return to the OS on free). Returns whether glibc accepted both.
pub fn tune_allocator_for_low_ram() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc allocator parameters; called at start.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1) == 1 && libc::mallopt(libc::M_MMAP_THRESHOLD, 64 * 1024) == 1
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

/// Blocks of 1 MiB or more go straight to mmap and back to the OS when freed, always:
/// glibc's threshold otherwise rises to the largest block freed (up to 32 MiB), after
/// which an ONNX Runtime arena's released chunks stay in the heap — resident until a
/// trim (measured: an OCR recogniser evicted with 34 MiB accounted gave back 379 MiB).
/// Returns whether glibc accepted it.
pub fn return_large_blocks() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc allocator parameters; called at start.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20) == 1
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

/// Lowers the calling thread's CPU priority to 10 below the server's own (nice 10 for a
/// server at 0; at most 19), unless it is lower already, for work that must not take the
/// cores from requests: beside a busy thread of the server's priority it gets about a
/// tenth of a core's share. Relative, so that a server started with `nice -n 10` still
/// puts its requests first. Not 19 always: at the lowest weight (1.5% of a busy core) a
/// one-second conversion could wait minutes beside a benchmark or a compiler. A thread
/// cannot raise its priority back without privileges, so only threads that end with
/// their work, or do only such work, call this.
pub fn lower_thread_priority() {
    let low = low_priority_nice();
    if thread_nice().is_some_and(|n| n >= low) {
        return;
    }
    // SAFETY: gettid takes no arguments; setpriority with PRIO_PROCESS and a thread id
    // changes only that thread's nice value (Linux threads are scheduled one by one).
    let done = unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, low)
    };
    if done != 0 {
        tracing::debug!("cannot lower a background thread's priority");
    }
}

/// Lowers the calling thread's priority as [`lower_thread_priority`] does and puts it in
/// the idle scheduling class (`SCHED_IDLE`), for the runs of long work: the kernel then
/// runs it only on cores no thread of normal priority wants, and preempts it at once when
/// one wakes up. Nice 10 alone left a short run about nine tenths of the cores, and (the
/// kernel letting a running thread finish its time slice) stalled its parallel loops
/// whenever one of its threads woke on a core the long work held: measured with 32-text
/// MiniLM batches beside an OCR detector running nonstop, p50 / p99 73-86 / 86-103 ms in
/// this class against 84-101 / 111-166 ms at nice 10. Whatever the class takes away
/// from long work beside a flood of short requests, the scheduler gives back in turns
/// (`lifecycle::turns`). The class is one-way: a thread without privileges cannot leave it.
pub fn idle_thread() {
    lower_thread_priority();
    #[cfg(target_os = "linux")]
    // SAFETY: sched_setscheduler with pid 0 changes only the calling thread's policy; the
    // parameter is a valid sched_param (priority 0, the only one SCHED_IDLE takes).
    let done = unsafe {
        let param = libc::sched_param { sched_priority: 0 };
        libc::sched_setscheduler(0, libc::SCHED_IDLE, &param)
    };
    #[cfg(not(target_os = "linux"))]
    let done = 0;
    if done != 0 {
        tracing::debug!("cannot put a long-work thread in the idle scheduling class");
    }
}

/// Whether the calling thread is in the idle scheduling class (see [`idle_thread`]).
#[cfg(test)]
pub(crate) fn thread_is_idle() -> bool {
    #[cfg(target_os = "linux")]
    // SAFETY: sched_getscheduler with pid 0 only reads the calling thread's policy.
    return unsafe { libc::sched_getscheduler(0) } == libc::SCHED_IDLE;
    #[cfg(not(target_os = "linux"))]
    false
}

/// The nice value [`lower_thread_priority`] gives a thread: 10 more than the server's.
pub fn low_priority_nice() -> i32 {
    (process_nice().unwrap_or(0) + 10).min(19)
}

/// The server's own nice value: its main thread's (whose id is the process id), which
/// nothing lowers.
fn process_nice() -> Option<i32> {
    nice_of(std::process::id() as libc::id_t)
}

/// The calling thread's nice value (-20 to 19), `None` if it cannot be read.
pub fn thread_nice() -> Option<i32> {
    // SAFETY: gettid takes no arguments.
    nice_of(unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t)
}

/// The nice value of the thread `tid` (Linux schedules threads one by one).
fn nice_of(tid: libc::id_t) -> Option<i32> {
    // SAFETY: getpriority only reads. It may return -1 as a value, so errno is cleared
    // first and read after.
    unsafe {
        *libc::__errno_location() = 0;
        let nice = libc::getpriority(libc::PRIO_PROCESS, tid);
        (nice != -1 || *libc::__errno_location() == 0).then_some(nice)
    }
}

/// Returns freed heap to the OS. glibc keeps freed arenas otherwise, so an unloaded
/// model would still count against the cgroup and RSS.
pub fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_and_stat_fields_parse() {
        let meminfo = "MemTotal:       24000000 kB\nMemFree: 1 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(meminfo_kib(meminfo, "MemTotal"), Some(24_000_000));
        assert_eq!(meminfo_kib(meminfo, "MemAvailable"), Some(20_000_000));
        assert_eq!(meminfo_kib(meminfo, "Missing"), None);
        let stat = "cache 10\ninactive_file 4096\nactive_file 1\n";
        assert_eq!(stat_field(stat, "inactive_file"), Some(4096));
        assert_eq!(stat_field(stat, "total_inactive_file"), None);
        // v1: hierarchical totals win; mapped file pages are not reclaimable.
        let v1 = "inactive_file 1\nactive_file 1\ntotal_inactive_file 1000\ntotal_active_file 500\ntotal_mapped_file 300\n";
        assert_eq!(reclaimable_cache(v1), 1200);
        let v2 = "anon 5\nfile 900\nactive_file 400\ninactive_file 500\nfile_mapped 100\n";
        assert_eq!(reclaimable_cache(v2), 800);
    }

    #[test]
    fn finds_v1_and_v2_cgroups() {
        let root = std::env::temp_dir().join(format!("snooze-cg-{}", std::process::id()));
        let v1 = root.join("memory/a/b");
        fs::create_dir_all(&v1).unwrap();
        fs::write(v1.join("memory.limit_in_bytes"), "1000\n").unwrap();
        let v2 = root.join("x/y");
        fs::create_dir_all(&v2).unwrap();
        fs::write(v2.join("memory.max"), "max\n").unwrap();
        let r = root.to_str().unwrap();
        assert!(matches!(parse_proc_cgroup("4:memory:/a/b\n0::/x/y\n", r), Some(Cgroup::V1(p)) if p == v1));
        assert!(matches!(parse_proc_cgroup("0::/x/y\n", r), Some(Cgroup::V2(p)) if p == v2));
        assert!(parse_proc_cgroup("0::/nope\n", r).is_none());
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn low_ram_tuning_is_accepted_by_glibc() {
        assert!(tune_allocator_for_low_ram());
        let big = vec![1u8; 1 << 20]; // above the 64 KiB threshold: served by mmap
        drop(big);
        trim_heap();
    }

    #[test]
    fn host_probe_reads_this_machine() {
        let s = HostProbe::new().snapshot();
        assert!(s.total_bytes > 0 && s.available_bytes <= s.total_bytes);
        assert!(s.process_bytes > 0);
    }
}
