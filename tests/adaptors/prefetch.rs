//! `PrefetchAdaptor`: managed memory is prefetched, the rest passed through.

use super::*;

#[test]
fn prefetch_managed_memory_and_pass_through_the_rest() {
    for device in devices() {
        let s = device.create_stream().unwrap();
        let managed = PrefetchAdaptor::new(ManagedResource::new(&device));
        assert_eq!(managed.memory_kind(), MemoryKind::Managed);
        let p = managed.allocate(MIB, &s).unwrap();
        assert_eq!(managed.prefetches_requested(), 1);
        // SAFETY: MIB live bytes at `p`, used on `s` only.
        unsafe { s.fill_u32(p, 7, MIB / 4) }.unwrap();
        assert_eq!(
            read_u32(&s, p.offset(MIB - 4), 1),
            [7],
            "{}",
            label(&device)
        );
        free(&managed, p, MIB, &s);
        let z = managed.allocate(0, &s).unwrap();
        free(&managed, z, 0, &s);
        assert_eq!(
            managed.prefetches_requested(),
            1,
            "zero bytes are not prefetched"
        );

        let device_memory = PrefetchAdaptor::new(CudaResource::new(&device));
        let p = device_memory.allocate(MIB, &s).unwrap();
        assert_eq!(device_memory.prefetches_requested(), 0);
        free(&device_memory, p, MIB, &s);
    }
}
