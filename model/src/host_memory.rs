//! The machine's memory, as the operating system reports it.

/// The machine's physical memory in bytes (Linux `/proc/meminfo`; `None` elsewhere).
pub fn total_ram_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
