package shopperintents;

import org.apache.flink.api.common.eventtime.Watermark;
import org.apache.flink.api.common.eventtime.WatermarkOutput;

/**
 * What {@link EventTimeWatermarks.Generator} promises, on a clock the spec moves by hand.
 * Run by tests/integration/test_event_time_watermarks.py; a broken promise exits non-zero.
 */
public final class EventTimeWatermarksSpec {
    private static final long BOUND_MS = 500;
    private static final long IDLE_ADVANCE_MS = 250;
    private static final long IDLENESS_MS = 5_000;

    private long now;
    private long watermark = Long.MIN_VALUE;
    private boolean idle;
    private final EventTimeWatermarks.Generator generator =
            new EventTimeWatermarks.Generator(
                    BOUND_MS, IDLE_ADVANCE_MS, IDLENESS_MS, 60_000, () -> now);
    private final WatermarkOutput output =
            new WatermarkOutput() {
                @Override
                public void emitWatermark(Watermark mark) {
                    watermark = mark.getTimestamp();
                    idle = false;
                }

                @Override
                public void markIdle() {
                    idle = true;
                }

                @Override
                public void markActive() {
                    idle = false;
                }
            };

    private void record(long wallMs, long timestampMs) {
        now = wallMs;
        generator.onEvent(null, timestampMs, output);
    }

    /** Periodic emits every 200 ms from the current time to {@code untilMs}. */
    private void emitUntil(long untilMs) {
        while (now + 200 <= untilMs) {
            now += 200;
            generator.onPeriodicEmit(output);
        }
    }

    private void emitAt(long wallMs) {
        now = wallMs;
        generator.onPeriodicEmit(output);
    }

    private static void check(boolean holds, String promise, long watermark) {
        if (!holds) {
            throw new AssertionError(promise + " (watermark " + watermark + ")");
        }
        System.out.println("ok: " + promise);
    }

    static void aBusyPartitionHoldsTheBoundBehindItsNewestRecord() {
        EventTimeWatermarksSpec s = new EventTimeWatermarksSpec();
        for (long t = 0; t <= 1_000; t += 100) {
            s.record(t, t);
            s.emitAt(t);
        }
        check(s.watermark == 1_000 - BOUND_MS - 1, "busy: newest record minus the bound", s.watermark);
    }

    static void aQuietPartitionFollowsTheWallClock() {
        EventTimeWatermarksSpec s = new EventTimeWatermarksSpec();
        s.record(0, 0);
        s.emitUntil(2_000);
        check(
                s.watermark == 2_000 - BOUND_MS - IDLE_ADVANCE_MS - 1,
                "quiet: the wall clock minus the bound and the idle advance",
                s.watermark);
    }

    static void aPausedTaskDoesNotMakeTheRecordsItMissedLate() {
        EventTimeWatermarksSpec s = new EventTimeWatermarksSpec();
        s.record(0, 0);
        s.emitAt(200);
        // The task stops for 3 s; a record stamped at 1 s waits unread meanwhile.
        s.emitAt(3_200);
        check(s.watermark < 1_000, "the first emit after a pause keeps the watermark", s.watermark);
        s.record(3_210, 1_000);
        s.emitUntil(3_800);
        check(s.watermark < 1_000, "a record from the pause is not behind the watermark", s.watermark);
        s.emitUntil(10_000);
        long lagMs = 3_210 - 1_000;
        check(
                s.watermark == 1_000 - BOUND_MS - 1 + (s.now - 3_210 - IDLE_ADVANCE_MS - lagMs),
                "after the hold the quiet partition follows the clock, less the record's lag",
                s.watermark);
    }

    static void aPartitionWithoutRecordsIsIdleAfterTheIdleness() {
        EventTimeWatermarksSpec s = new EventTimeWatermarksSpec();
        s.emitUntil(IDLENESS_MS - 200);
        check(!s.idle, "no record yet: holds the others back until the idleness", s.watermark);
        s.emitUntil(IDLENESS_MS);
        check(s.idle, "no record after the idleness: idle", s.watermark);
    }

    public static void main(String[] args) {
        aBusyPartitionHoldsTheBoundBehindItsNewestRecord();
        aQuietPartitionFollowsTheWallClock();
        aPausedTaskDoesNotMakeTheRecordsItMissedLate();
        aPartitionWithoutRecordsIsIdleAfterTheIdleness();
    }
}
