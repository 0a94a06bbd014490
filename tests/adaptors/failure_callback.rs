//! `FailureCallbackAdaptor`: the callback frees and retries until it says no.

use super::*;

#[test]
fn failure_callback_frees_and_retries_until_it_says_no() {
    for device in devices() {
        let p = Arc::new(pool(&device, 0, 4 * MIB));
        let s = device.create_stream().unwrap();
        let held = Arc::new(Mutex::new(Some(p.allocate(4 * MIB, &s).unwrap())));
        let calls = Arc::new(Mutex::new(Vec::new()));
        let adaptor = FailureCallbackAdaptor::new(p.clone(), {
            let (p, s, held, calls) = (p.clone(), s.clone(), held.clone(), calls.clone());
            move |bytes| {
                calls.lock().unwrap().push(bytes);
                match held.lock().unwrap().take() {
                    Some(ptr) => {
                        free(&*p, ptr, 4 * MIB, &s);
                        true
                    }
                    None => false,
                }
            }
        });
        // Full: the callback frees the held block and asks for a retry, which succeeds.
        let a = adaptor.allocate(2 * MIB, &s).unwrap();
        assert_eq!(*calls.lock().unwrap(), [2 * MIB], "{}", label(&device));
        // Full again with nothing to free: the callback says no, the error comes back.
        match adaptor.allocate(3 * MIB, &s) {
            Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, 3 * MIB),
            other => panic!("{other:?}"),
        }
        assert_eq!(*calls.lock().unwrap(), [2 * MIB, 3 * MIB]);
        assert_eq!(adaptor.callbacks(), 2);
        // Errors other than out-of-memory do not call it.
        assert!(matches!(
            adaptor.allocate(usize::MAX, &s),
            Err(Error::InvalidSize { .. })
        ));
        assert_eq!(adaptor.callbacks(), 2);
        // Enough memory: no call.
        let b = adaptor.allocate(MIB, &s).unwrap();
        assert_eq!(adaptor.callbacks(), 2);
        free(&adaptor, a, 2 * MIB, &s);
        free(&adaptor, b, MIB, &s);
    }
}

#[test]
fn failure_callback_retries_while_it_returns_true() {
    for device in devices() {
        let s = device.create_stream().unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        // Upstream: a log, to count the failed tries that reach it.
        let buf = SharedBuf::default();
        let adaptor = FailureCallbackAdaptor::new(
            LoggingAdaptor::new(pool(&device, 0, 4 * MIB), buf.clone()),
            {
                let calls = calls.clone();
                move |_| calls.fetch_add(1, Ordering::SeqCst) < 3
            },
        );
        assert!(adaptor
            .allocate(8 * MIB, &s)
            .unwrap_err()
            .is_out_of_memory());
        assert_eq!(calls.load(Ordering::SeqCst), 4);
        let lines = parse_log(&buf.text());
        assert_eq!(
            lines
                .iter()
                .filter(|l| l.action == "allocate failure")
                .count(),
            4,
            "{}",
            label(&device)
        );
    }
}
